"""The tables. SQL is the source of truth: everything a run needs to be resumed lives here.

Timestamps are naive UTC, taken from the database clock (`Database.now`) wherever they are
compared across hosts (heartbeats, requeue deadlines).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    Numeric,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

ID = String(36)


class Base(DeclarativeBase):
    type_annotation_map = {dict[str, Any]: JSON, list[Any]: JSON, datetime: DateTime()}


class Tenant(Base):
    __tablename__ = "tenants"

    id: Mapped[str] = mapped_column(ID, primary_key=True)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    created_at: Mapped[datetime]
    max_concurrent_runs: Mapped[int | None] = mapped_column(default=None)  # own limit, or None
    weight: Mapped[int | None] = mapped_column(default=None)  # share of fair dispatch, None: 1
    # own `Runs.Retention` in whole seconds; 0 keeps its runs forever; None: the setting's
    retention_seconds: Mapped[int | None] = mapped_column(BigInteger, default=None)


class ApiKey(Base):
    """An API key is shown once; only its SHA-256 is kept, found by its public prefix."""

    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)  # the key's public prefix
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), index=True)
    secret_hash: Mapped[str] = mapped_column(String(64))
    label: Mapped[str] = mapped_column(String(200), default="")
    created_at: Mapped[datetime]
    revoked_at: Mapped[datetime | None]
    last_used_at: Mapped[datetime | None]  # to the minute: written at most once a minute


class Run(Base):
    __tablename__ = "runs"
    __table_args__ = (
        Index("ix_runs_tenant_created", "tenant_id", "created_at", "id"),
        Index("ix_runs_status_enqueued", "status", "enqueued_at"),
        Index("ix_runs_status_heartbeat", "status", "heartbeat_at"),
        Index("ix_runs_root", "root_run_id"),
        Index("ix_runs_session", "tenant_id", "session_id"),
        # retention: a tenant's oldest ended runs, and the runs that continue a chain
        Index("ix_runs_tenant_ended", "tenant_id", "ended_at", "id"),
        Index("ix_runs_continued_from", "continued_from_run_id"),
    )

    id: Mapped[str] = mapped_column(ID, primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"))
    agent: Mapped[str] = mapped_column(String(200))
    kind: Mapped[str] = mapped_column(String(20), default="agent")
    status: Mapped[str] = mapped_column(String(20))
    input: Mapped[dict[str, Any]]
    parameters: Mapped[dict[str, Any] | None]
    output: Mapped[dict[str, Any] | None]
    messages: Mapped[list[Any] | None]  # the conversation after the last finished turn
    turns_completed: Mapped[int] = mapped_column(Integer, default=0)
    session_id: Mapped[str | None] = mapped_column(String(200))
    parent_run_id: Mapped[str | None] = mapped_column(ID)
    root_run_id: Mapped[str] = mapped_column(ID)
    depth: Mapped[int] = mapped_column(Integer, default=0)
    continued_from_run_id: Mapped[str | None] = mapped_column(ID)
    attempt: Mapped[int] = mapped_column(Integer, default=1)
    priority: Mapped[int] = mapped_column(Integer, default=5, server_default="5")  # 0-9
    model_id: Mapped[str | None] = mapped_column(String(200))
    input_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    output_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    cost_amount: Mapped[float] = mapped_column(Numeric(18, 8), default=0)
    cost_currency: Mapped[str] = mapped_column(String(8), default="USD")
    cost_source: Mapped[str] = mapped_column(String(20), default="Configured")
    error_type: Mapped[str | None] = mapped_column(String(60))
    error_class: Mapped[str | None] = mapped_column(String(60))
    error_message: Mapped[str | None] = mapped_column(Text)
    error_retry_after: Mapped[float | None] = mapped_column(Float)
    model_attempts: Mapped[list[Any] | None]  # one entry per fallback link tried
    owner: Mapped[str | None] = mapped_column(String(200))
    fence: Mapped[int] = mapped_column(Integer, default=0)
    event_seq: Mapped[int] = mapped_column(Integer, default=0)  # last event seq handed out
    created_at: Mapped[datetime]
    enqueued_at: Mapped[datetime | None]  # outbox: set once the broker took the message
    enqueue_count: Mapped[int] = mapped_column(Integer, default=0)
    started_at: Mapped[datetime | None]
    ended_at: Mapped[datetime | None]
    heartbeat_at: Mapped[datetime | None]
    cancel_requested_at: Mapped[datetime | None]
    waiting_since: Mapped[datetime | None]  # set while a person must act
    waited_ms: Mapped[int] = mapped_column(BigInteger, default=0)  # MaxDuration excludes it
    resumable: Mapped[bool] = mapped_column(Boolean, default=False)  # a job owns it (async)
    traceparent: Mapped[str | None] = mapped_column(String(55))  # its submission's span
    # a workflow run's code version, as the worker that executed it ran it (`workflows.registry`)
    workflow_version: Mapped[str | None] = mapped_column(String(64))


class RunEvent(Base):
    __tablename__ = "run_events"
    __table_args__ = (UniqueConstraint("run_id", "seq", name="uq_run_events_run_seq"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id"))
    seq: Mapped[int] = mapped_column(Integer)
    type: Mapped[str] = mapped_column(String(60))
    at: Mapped[datetime]
    data: Mapped[dict[str, Any]]


class ToolCallRecord(Base):
    """The ledger: one row per tool execution, `started` before the body runs."""

    __tablename__ = "tool_calls"
    __table_args__ = (
        UniqueConstraint("run_id", "turn", "call_id", name="uq_tool_calls_run_turn_call"),
        Index("ix_tool_calls_run_tool_args", "run_id", "tool", "args_hash"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id"))
    turn: Mapped[int] = mapped_column(Integer)
    call_id: Mapped[str] = mapped_column(String(200))
    tool: Mapped[str] = mapped_column(String(200))
    args_hash: Mapped[str] = mapped_column(String(64))
    arguments: Mapped[dict[str, Any]]
    execution_id: Mapped[str] = mapped_column(ID)
    idempotency_key: Mapped[str] = mapped_column(String(200))
    status: Mapped[str] = mapped_column(String(20))  # started | succeeded | failed
    result: Mapped[dict[str, Any] | None]
    error_code: Mapped[str | None] = mapped_column(String(60))
    error_message: Mapped[str | None] = mapped_column(Text)
    attempt: Mapped[int] = mapped_column(Integer, default=1)
    started_at: Mapped[datetime]
    ended_at: Mapped[datetime | None]


class IdempotencyRecord(Base):
    """One `Idempotency-Key` of one tenant: reserved (`InProgress`), then the stored 2xx.

    The unique (tenant_id, key) makes the reservation one atomic insert across processes.
    """

    __tablename__ = "idempotency_records"
    __table_args__ = (
        UniqueConstraint("tenant_id", "key", name="uq_idempotency_records_tenant_key"),
        Index("ix_idempotency_records_state_created", "state", "created_at"),
        Index("ix_idempotency_records_run", "run_id"),  # retention deletes a run's records
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"))
    key: Mapped[str] = mapped_column(Text)
    method: Mapped[str] = mapped_column(String(10))
    path: Mapped[str] = mapped_column(Text)
    fingerprint: Mapped[str] = mapped_column(String(64))  # sha256 of method, path, raw body
    state: Mapped[str] = mapped_column(String(20))  # InProgress | Completed
    run_id: Mapped[str | None] = mapped_column(ID)
    response_status: Mapped[int | None] = mapped_column(Integer)
    response_body: Mapped[bytes | None] = mapped_column(LargeBinary)
    content_type: Mapped[str | None] = mapped_column(String(200))
    location: Mapped[str | None] = mapped_column(Text)
    preference_applied: Mapped[str | None] = mapped_column(String(200))
    created_at: Mapped[datetime]
    completed_at: Mapped[datetime | None]


class Approval(Base):
    """One tool call waiting for a person, then decided once and consumed at most once.

    Keyed by the call it authorizes (run, ledger turn, the model's call id); the decision
    and the consumption are each one conditional UPDATE, so no two processes can both win.
    """

    __tablename__ = "approvals"
    __table_args__ = (
        UniqueConstraint("run_id", "turn", "call_id", name="uq_approvals_run_turn_call"),
        Index("ix_approvals_tenant_status_requested", "tenant_id", "status", "requested_at", "id"),
        Index("ix_approvals_tenant_requested", "tenant_id", "requested_at", "id"),
        Index("ix_approvals_status_expires", "status", "expires_at"),
        Index("ix_approvals_run_tool_args", "run_id", "tool", "args_hash"),
    )

    id: Mapped[str] = mapped_column(ID, primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"))
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id"))
    turn: Mapped[int] = mapped_column(Integer)
    call_id: Mapped[str] = mapped_column(String(200))
    tool: Mapped[str] = mapped_column(String(200))
    arguments: Mapped[dict[str, Any]]
    args_hash: Mapped[str] = mapped_column(String(64))
    execution_id: Mapped[str] = mapped_column(ID)
    status: Mapped[str] = mapped_column(String(20))  # Pending|Approved|Rejected|Expired|Canceled
    requested_at: Mapped[datetime]
    expires_at: Mapped[datetime]
    decided_at: Mapped[datetime | None]
    decided_by: Mapped[str | None] = mapped_column(String(200))
    comment: Mapped[str | None] = mapped_column(Text)
    consumed_at: Mapped[datetime | None]


class WorkflowNode(Base):
    """A finished node of a workflow run (its checkpoint) or a question put to a person.

    A continuation replays the workflow and answers each node found here in its chain
    instead of running it; a request is answered exactly once (`asked` -> `answered`).
    """

    __tablename__ = "workflow_nodes"
    __table_args__ = (
        UniqueConstraint("run_id", "node", name="uq_workflow_nodes_run_node"),
        Index("ix_workflow_nodes_status_due", "status", "due_at"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id"))
    node: Mapped[str] = mapped_column(String(300))
    kind: Mapped[str] = mapped_column(String(20))  # step | agent | ask | timer | event
    status: Mapped[str] = mapped_column(String(20))  # completed | asked | answered
    payload: Mapped[dict[str, Any] | None]
    result: Mapped[dict[str, Any] | None]  # {"value": ...}, and `"timedOut": true` for an event
    created_at: Mapped[datetime]
    answered_at: Mapped[datetime | None]
    due_at: Mapped[datetime | None]  # a waiting timer's time, an event wait's timeout


class WorkflowEvent(Base):
    """An event delivered to a workflow's chain that no node waited for yet: the chain's
    `ctx.wait_for(name)` takes it (oldest first, once: `consumed_at`)."""

    __tablename__ = "workflow_events"
    __table_args__ = (Index("ix_workflow_events_waiting", "chain_id", "name", "consumed_at", "id"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"))
    chain_id: Mapped[str] = mapped_column(ForeignKey("runs.id"))  # the chain's first run
    name: Mapped[str] = mapped_column(String(200))
    payload: Mapped[dict[str, Any] | None]  # {"value": ...}
    created_at: Mapped[datetime]
    consumed_at: Mapped[datetime | None]
    consumed_by: Mapped[str | None] = mapped_column(String(36))  # the run that took it


class TenantQuotaOverride(Base):
    """A tenant's own cost quota, set by an operator; without a row the tenant has
    `Tenants.DefaultQuota`. A row whose `cost_limit` is null gives the tenant no quota."""

    __tablename__ = "tenant_quotas"

    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), primary_key=True)
    period: Mapped[str] = mapped_column(String(10))  # day | month
    cost_limit: Mapped[float | None] = mapped_column(Numeric(18, 8))
    updated_at: Mapped[datetime]


class WebhookEndpoint(Base):
    """Where a tenant wants its events sent. The secret signs every delivery (Standard
    Webhooks); during a rotation's grace period the previous one signs beside it."""

    __tablename__ = "webhook_endpoints"
    __table_args__ = (Index("ix_webhook_endpoints_tenant", "tenant_id", "created_at", "id"),)

    id: Mapped[str] = mapped_column(ID, primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"))
    url: Mapped[str] = mapped_column(String(2000))
    events: Mapped[list[Any]]  # the event types it receives
    description: Mapped[str | None] = mapped_column(Text)
    secret: Mapped[str] = mapped_column(String(100))
    previous_secret: Mapped[str | None] = mapped_column(String(100))
    previous_secret_until: Mapped[datetime | None]
    enabled: Mapped[bool] = mapped_column(Boolean, default=True)
    disabled_at: Mapped[datetime | None]
    disabled_reason: Mapped[str | None] = mapped_column(String(200))
    failing_since: Mapped[datetime | None]  # the first failed attempt since the last success
    created_at: Mapped[datetime]
    updated_at: Mapped[datetime]


class WebhookMessage(Base):
    """The outbox: one event to tell, written in the transaction of the state change that
    causes it (or, for Redis-held state, moved here from the script that changed it).

    `body` is rendered once, as the message is fanned out to its deliveries, so that every
    attempt and every redelivery sends the same bytes under the same `webhook-id` (`id`)."""

    __tablename__ = "webhook_messages"
    __table_args__ = (Index("ix_webhook_messages_fanned", "fanned_at", "created_at"),)

    id: Mapped[str] = mapped_column(String(40), primary_key=True)  # msg_<26 sortable chars>
    tenant_id: Mapped[str | None] = mapped_column(ID)  # None: an operator event
    type: Mapped[str] = mapped_column(String(60))
    subject_id: Mapped[str | None] = mapped_column(String(200))  # the run, approval, provider
    data: Mapped[dict[str, Any]]  # what the writer knew; the body is rendered from it
    dedupe_key: Mapped[str | None] = mapped_column(String(300), unique=True)
    created_at: Mapped[datetime]
    body: Mapped[str | None] = mapped_column(Text)
    fanned_at: Mapped[datetime | None]
    claim_until: Mapped[datetime | None]  # a fan-out in progress


class WebhookDelivery(Base):
    """One message to one target: an endpoint's id, `operator` or `slack`. Claimed by one
    worker at a time (`claim_until`); `pending` until a 2xx (`delivered`), the end of the
    retry schedule (`failed`) or the endpoint's removal (`canceled`)."""

    __tablename__ = "webhook_deliveries"
    __table_args__ = (
        UniqueConstraint("message_id", "target", name="uq_webhook_deliveries_message_target"),
        Index("ix_webhook_deliveries_due", "status", "next_attempt_at"),
        Index("ix_webhook_deliveries_target", "target", "created_at", "id"),
    )

    id: Mapped[str] = mapped_column(ID, primary_key=True)
    message_id: Mapped[str] = mapped_column(ForeignKey("webhook_messages.id"))
    target: Mapped[str] = mapped_column(String(36))
    tenant_id: Mapped[str | None] = mapped_column(ID)
    status: Mapped[str] = mapped_column(String(20))
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    next_attempt_at: Mapped[datetime]
    claimed_by: Mapped[str | None] = mapped_column(String(200))
    claim_until: Mapped[datetime | None]
    last_status: Mapped[int | None] = mapped_column(Integer)
    last_error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime]
    delivered_at: Mapped[datetime | None]


class WebhookAttempt(Base):
    """One try of a delivery: when, the answer's status, how long it took, what went wrong
    and the start of the answer's body (truncated)."""

    __tablename__ = "webhook_attempts"
    __table_args__ = (Index("ix_webhook_attempts_delivery", "delivery_id", "id"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    delivery_id: Mapped[str] = mapped_column(ForeignKey("webhook_deliveries.id"))
    attempted_at: Mapped[datetime]
    status: Mapped[int | None] = mapped_column(Integer)
    latency_ms: Mapped[int] = mapped_column(Integer)
    error: Mapped[str | None] = mapped_column(Text)
    response: Mapped[str | None] = mapped_column(Text)


class SlackMessage(Base):
    """The Slack message that asked for an approval, so its outcome can be written into it."""

    __tablename__ = "slack_messages"

    approval_id: Mapped[str] = mapped_column(ForeignKey("approvals.id"), primary_key=True)
    channel: Mapped[str] = mapped_column(String(100))
    ts: Mapped[str] = mapped_column(String(40))
    posted_at: Mapped[datetime]
    updated_status: Mapped[str | None] = mapped_column(String(20))  # the outcome written in it


class Schedule(Base):
    """Runs of an agent or a workflow at the slots of a cron expression (in `timezone`) or of
    an interval from `anchor_at`. `next_fire_at` is the next slot the firing pass acts on
    (null while paused); the pass advances it in the transaction that records each slot."""

    __tablename__ = "schedules"
    __table_args__ = (
        UniqueConstraint("tenant_id", "name", name="uq_schedules_tenant_name"),
        Index("ix_schedules_tenant_created", "tenant_id", "created_at", "id"),
        Index("ix_schedules_next_fire", "next_fire_at"),
        Index("ix_schedules_queued", "queued_slot_at"),
    )

    id: Mapped[str] = mapped_column(ID, primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"))
    name: Mapped[str] = mapped_column(String(100))
    cron: Mapped[str | None] = mapped_column(String(200))
    timezone: Mapped[str] = mapped_column(String(64), default="UTC")
    interval_ms: Mapped[int | None] = mapped_column(BigInteger)
    anchor_at: Mapped[datetime]  # an interval's slots are anchor + k * interval, k >= 1
    target_kind: Mapped[str] = mapped_column(String(20))  # agent | workflow
    target_name: Mapped[str] = mapped_column(String(200))
    input: Mapped[dict[str, Any]]
    overlap: Mapped[str] = mapped_column(String(20))  # skip | queue | cancel_previous
    catch_up: Mapped[str] = mapped_column(String(20))  # none | latest | all
    paused: Mapped[bool] = mapped_column(Boolean, default=False)
    next_fire_at: Mapped[datetime | None]
    last_fire_at: Mapped[datetime | None]  # the slot of the last run started
    last_run_id: Mapped[str | None] = mapped_column(ID)
    queued_slot_at: Mapped[datetime | None]  # a slot waiting for the previous run (`queue`)
    created_at: Mapped[datetime]
    updated_at: Mapped[datetime]


class ScheduleFire(Base):
    """One slot of a schedule, recorded once: the primary key makes the insert that records it
    the one guard against a second firing (two passes, two beats, a pass after a crash)."""

    __tablename__ = "schedule_fires"
    __table_args__ = (Index("ix_schedule_fires_run", "run_id"),)

    schedule_id: Mapped[str] = mapped_column(ForeignKey("schedules.id"), primary_key=True)
    slot_at: Mapped[datetime] = mapped_column(primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ID)
    outcome: Mapped[str] = mapped_column(String(20))  # fired|skipped|queued|missed|failed
    run_id: Mapped[str | None] = mapped_column(ID)
    fired_at: Mapped[datetime]
    detail: Mapped[str | None] = mapped_column(Text)
