"""The webhook event types: what each one tells, and which state change writes it.

A tenant's endpoint subscribes to tenant events; the operator's endpoint (configuration) also
hears the installation's own (`circuit.*`, `webhook.disabled` of any tenant). Every payload is
`{"type", "timestamp", "data"}`, `data` in the API's shape of its subject.
"""

from __future__ import annotations

from typing import Final

TENANT_EVENTS: Final[dict[str, str]] = {
    "run.completed": "A run ended `Completed`; data: the run, as `GET /api/runs/{id}`.",
    "run.failed": "A run ended `Failed`; data: the run, its `error` included.",
    "run.canceled": "A run ended `Canceled`; data: the run.",
    "approval.requested": "A tool call waits for a person; data: the approval, as "
    "`GET /api/approvals/{id}`.",
    "approval.decided": "An approval was approved or rejected; data: the approval.",
    "approval.expired": "An approval's time ran out undecided; data: the approval.",
    "workflow.waiting": "A workflow asked a person (`ctx.ask`) and waits; data: the run and "
    "the request.",
    "quota.exceeded": "The tenant's cost quota is spent for its period (once a period); data: "
    "the quota, as `GET /api/quota`.",
    "webhook.disabled": "One of the tenant's endpoints was disabled after failing for "
    "`Webhooks.DisableAfter`; data: the endpoint (no secret).",
}

OPERATOR_EVENTS: Final[dict[str, str]] = {
    "circuit.opened": "A provider's circuit opened; data: the circuit, as in `GET /api/circuits`.",
    "circuit.closed": "A provider's circuit closed again; data: the circuit.",
}

EVENT_TYPES: Final[dict[str, str]] = {**TENANT_EVENTS, **OPERATOR_EVENTS}
"""Every type, for the docs and for validating an endpoint's `events`."""


def unknown_types(types: list[str], *, operator: bool = False) -> list[str]:
    """The entries of an endpoint's `events` that it cannot subscribe to."""
    allowed = EVENT_TYPES if operator else TENANT_EVENTS
    return [type_ for type_ in types if type_ not in allowed]


CHANGED_CHANNEL: Final = "tracon:webhooks:changed"
"""Redis pub/sub channel told after an endpoint is created, changed or removed, so that every
process refreshes at once which event types anyone wants (`webhooks.subscriptions`)."""

WAKE_CHANNEL: Final = "tracon:webhooks:wake"
"""Redis pub/sub channel told after a commit wrote outbox messages, so that the workers'
deliverers start at once instead of at their next poll."""
