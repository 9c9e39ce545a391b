"""The public JSON shapes of a run (the contract's "The run") and of an approval, shared by
HTTP and the CLI."""

from __future__ import annotations

from typing import Any

from tracon_jobs.db.models import Approval, Run, ToolCallRecord
from tracon_jobs.runs.store import iso


def run_json(
    run: Run, tenant_name: str | None = None, pending_approvals: list[str] | None = None
) -> dict[str, Any]:
    error: dict[str, Any] | None = None
    if run.error_type:
        error = {"type": run.error_type, "class": run.error_class, "message": run.error_message}
        if run.error_retry_after is not None:
            error["retryAfter"] = run.error_retry_after
    return {
        "id": run.id,
        "tenant": tenant_name or run.tenant_id,
        "agent": run.agent,
        "kind": run.kind,
        "status": run.status,
        "input": run.input,
        "output": run.output,
        "sessionId": run.session_id,
        "parentRunId": run.parent_run_id,
        "rootRunId": run.root_run_id,
        "depth": run.depth,
        "continuedFromRunId": run.continued_from_run_id,
        "attempt": run.attempt,
        "traceparent": run.traceparent,
        "workflowVersion": run.workflow_version,
        "modelId": run.model_id,
        "usage": {
            "inputTokens": run.input_tokens,
            "outputTokens": run.output_tokens,
            "totalTokens": run.input_tokens + run.output_tokens,
        },
        "cost": {
            "amount": float(run.cost_amount or 0),
            "currency": run.cost_currency,
            "source": run.cost_source,
        },
        "error": error,
        "attempts": run.model_attempts or [],
        "createdAt": iso(run.created_at),
        "startedAt": iso(run.started_at),
        "endedAt": iso(run.ended_at),
        "heartbeatAt": iso(run.heartbeat_at),
        "cancelRequestedAt": iso(run.cancel_requested_at),
        "pendingApprovals": pending_approvals or [],
    }


def approval_json(approval: Approval) -> dict[str, Any]:
    return {
        "id": approval.id,
        "runId": approval.run_id,
        "tool": approval.tool,
        "callId": approval.call_id,
        "arguments": approval.arguments,
        "executionId": approval.execution_id,
        "status": approval.status,
        "requestedAt": iso(approval.requested_at),
        "expiresAt": iso(approval.expires_at),
        "decidedAt": iso(approval.decided_at),
        "decidedBy": approval.decided_by,
        "comment": approval.comment,
        "consumedAt": iso(approval.consumed_at),
    }


def tool_call_json(record: ToolCallRecord) -> dict[str, Any]:
    """One ledger row: the call, its stored result or error, its attempts and times."""
    error: dict[str, Any] | None = None
    if record.error_code is not None or record.error_message is not None:
        error = {"code": record.error_code, "message": record.error_message}
    duration_ms: int | None = None
    if record.started_at is not None and record.ended_at is not None:
        duration_ms = round((record.ended_at - record.started_at).total_seconds() * 1000)
    return {
        "id": record.id,
        "turn": record.turn,
        "callId": record.call_id,
        "tool": record.tool,
        "arguments": record.arguments,
        "executionId": record.execution_id,
        "idempotencyKey": record.idempotency_key,
        "status": record.status,
        "result": (record.result or {}).get("value"),
        "error": error,
        "attempts": record.attempt,
        "startedAt": iso(record.started_at),
        "endedAt": iso(record.ended_at),
        "durationMs": duration_ms,
    }
