"""Benchmarks that start the real processes (web, worker, Redis, SQL) and time them."""
