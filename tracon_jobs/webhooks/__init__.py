"""Webhooks: events of runs, approvals, quotas and circuits, signed by the Standard Webhooks
scheme and delivered at least once (in practice once) from an outbox written in the same
transaction as the state change that causes them."""
