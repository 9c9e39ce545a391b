"""The approvals surface: a tenant's inbox, one approval, and the decision (200 once).

A decision is accepted while the node drains (its run's job waits in the queue until a
worker takes it, as the reliability guide's drain rules say of approval decisions), and
`Idempotency-Key` makes a retried decision replay the first answer instead of a 409.
"""

from __future__ import annotations

from flask import Blueprint, Response, jsonify, request
from pydantic import BaseModel, ConfigDict, Field

from tracon_jobs.runs.approvals import ApprovalConflict, ApprovalNotFound, ApprovalStatus
from tracon_jobs.runs.views import approval_json
from web.auth import key_prefix, require_tenant, tenant_id
from web.extensions import runtime
from web.idempotency import idempotent
from web.problems import Problem, bad_request, not_found
from web.runs import decode_cursor, keyset_page, page_size, parse_body

bp = Blueprint("approvals", __name__, url_prefix="/api")
require_tenant(bp)

STATUSES = {status.value for status in ApprovalStatus}


class Decision(BaseModel):
    model_config = ConfigDict(extra="forbid")

    approve: bool = Field(strict=True)
    comment: str | None = Field(default=None, max_length=2000)


@bp.get("/approvals")
def list_approvals() -> Response:
    status = request.args.get("status")
    if status is not None and status not in STATUSES:
        raise bad_request(f"status: must be one of {', '.join(sorted(STATUSES))}", field="status")
    limit = page_size(request.args.get("limit"))
    before = decode_cursor(request.args.get("cursor"))
    rows = runtime().approval_store.page(
        tenant_id(), status=status, run_id=request.args.get("runId"), limit=limit + 1, before=before
    )
    page, cursor = keyset_page(rows, limit, lambda a: (a.requested_at, a.id))
    return jsonify({"items": [approval_json(a) for a in page], "nextCursor": cursor})


@bp.get("/approvals/<approval_id>")
def get_approval(approval_id: str) -> Response:
    approval = runtime().approval_store.get(approval_id, tenant_id())
    if approval is None:
        raise not_found(f"no approval '{approval_id}'")
    return jsonify(approval_json(approval))


@bp.post("/approvals/<approval_id>/decision")
@idempotent()
def decide(approval_id: str) -> Response:
    body: Decision = parse_body(Decision)
    try:
        decided = runtime().approvals.decide(
            tenant_id(), approval_id, body.approve, body.comment, decided_by=key_prefix()
        )
    except ApprovalNotFound:
        raise not_found(f"no approval '{approval_id}'") from None
    except ApprovalConflict as conflict:
        raise Problem(
            409,
            "Conflict",
            f"approval '{approval_id}' cannot be decided: {conflict}",
            approvalStatus=conflict.approval.status,
        ) from None
    return jsonify(approval_json(decided.approval))
