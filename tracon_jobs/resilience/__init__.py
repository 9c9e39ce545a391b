"""Provider resilience: failure classification, the cluster-wide circuit breaker, fallback
chains and per-provider concurrency slots."""
