"""The body of a webhook message: `{"type", "timestamp", "data"}`, `data` in the API's shape of
its subject.

Rendered once, when the message is fanned out to its deliveries (the deliverer stores the JSON
in `webhook_messages.body`), so that every attempt and redelivery sends the same bytes. A run's
message shows the run as `GET /api/runs/{id}` does (a run that ended does not change again); an
approval's shows it as `GET /api/approvals/{id}` showed it right after the event, whatever
happened to it since (a request rendered after its decision still says `Pending`); the
messages of Redis-held or configuration-held state (`quota.exceeded`, `circuit.*`,
`webhook.disabled`) carry their data, in the API's shape already, as written.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

from sqlalchemy import select
from sqlalchemy.orm import Session

from tracon_jobs.db.models import Approval, Run, WebhookMessage, WorkflowNode
from tracon_jobs.runs.approvals import ApprovalStatus
from tracon_jobs.runs.store import iso
from tracon_jobs.runs.views import approval_json, run_json

Links = Callable[[Approval], dict[str, Any] | None]
"""Where an approval may be decided besides the API (one-time links): the `links` of its
payload, or None for none."""

STATUS_AFTER: Final = {
    "approval.requested": ApprovalStatus.PENDING.value,
    "approval.expired": ApprovalStatus.EXPIRED.value,
}
OUTCOMES: Final = {
    "approved": ApprovalStatus.APPROVED.value,
    "rejected": ApprovalStatus.REJECTED.value,
}
UNDECIDED: Final = ("decidedAt", "decidedBy", "comment")


def render(
    session: Session, message: WebhookMessage, *, links: Links | None = None
) -> dict[str, Any]:
    """The payload of `message`, read in `session` (`links`: see `Links`)."""
    return {
        "type": message.type,
        "timestamp": iso(message.created_at),
        "data": _data(session, message, links),
    }


def _data(session: Session, message: WebhookMessage, links: Links | None) -> dict[str, Any]:
    kind = message.type
    if kind.startswith("run."):
        return run_view(session, message.subject_id or "") or dict(message.data)
    if kind.startswith("approval."):
        return approval_view(session, message, links) or dict(message.data)
    if kind == "workflow.waiting":
        return waiting_view(session, message)
    return dict(message.data)


def run_view(session: Session, run_id: str) -> dict[str, Any] | None:
    """The run as `GET /api/runs/{id}` shows it: with the approvals it waits for."""
    run = session.get(Run, run_id)
    if run is None:
        return None
    pending: list[str] = []
    if run.status == "Waiting":
        query = (
            select(Approval.id)
            .where(Approval.run_id == run_id, Approval.status == ApprovalStatus.PENDING.value)
            .order_by(Approval.requested_at, Approval.id)
        )
        pending = list(session.scalars(query))
    return run_json(run, pending_approvals=pending)


def approval_view(
    session: Session, message: WebhookMessage, links: Links | None = None
) -> dict[str, Any] | None:
    """The approval as `GET /api/approvals/{id}` showed it right after the event."""
    approval = session.get(Approval, message.subject_id)
    if approval is None:
        return None
    view = approval_json(approval)
    view["consumedAt"] = None  # used only after the event, by the run that goes on
    if message.type == "approval.requested":
        view.update(dict.fromkeys(UNDECIDED))
    status = STATUS_AFTER.get(message.type) or OUTCOMES.get(str(message.data.get("outcome")))
    view["status"] = status or view["status"]
    extra = links(approval) if links is not None else None
    if extra:
        view["links"] = extra
    return view


def waiting_view(session: Session, message: WebhookMessage) -> dict[str, Any]:
    """The run and what its workflow asks (`ctx.ask`: the node and its payload)."""
    run_id = message.subject_id or ""
    node = str(message.data.get("request"))
    payload = session.scalar(
        select(WorkflowNode.payload).where(
            WorkflowNode.run_id == run_id, WorkflowNode.node == node, WorkflowNode.kind == "ask"
        )
    )
    request = {"node": node, "payload": (payload or {}).get("value")}
    return {"run": run_view(session, run_id), "request": request}
