"""The operator view of each provider's circuit and concurrency slots, shared by the HTTP API
(`GET /api/circuits`) and `tracon-jobs circuits`."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tracon_jobs.resilience.breaker import CircuitBreaker
    from tracon_jobs.resilience.concurrency import Slots
    from tracon_jobs.resilience.rate_limits import RateLimits


def circuits_view(
    breaker: CircuitBreaker,
    slots: Slots,
    providers: Iterable[str],
    rate_limits: RateLimits | None = None,
) -> list[dict[str, Any]]:
    """Every provider named, sorted: its circuit, its concurrency slots, and its rate limits
    (each limited scope's window now)."""
    views = []
    for name in sorted(providers):
        circuit = breaker.snapshot(name)
        usage = slots.usage(name)
        views.append(
            {
                "provider": name,
                "state": circuit.state,
                "consecutiveFailures": circuit.failures,
                "retryAfter": circuit.retry_after_ms / 1000 if circuit.retry_after_ms else None,
                "probesInFlight": circuit.probes,
                "slots": {"limit": usage.limit, "inUse": usage.in_use, "waiting": usage.waiting},
                "rateLimits": [
                    rate.as_json() for rate in (rate_limits.usage(name) if rate_limits else [])
                ],
            }
        )
    return views
