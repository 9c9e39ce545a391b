"""The outbox: which state changes become webhook messages, written in the transaction of the
change itself, so that a crash between the two can neither lose a message nor invent one.

Run events are written by the run store (`RunWrites`), approvals' and workflows' through it;
for each it asks `WebhookOutbox.messages` which messages the events cause and inserts them
with the events (`runs.store.statements.message_insert`: the tenant is read from the run row
by the insert, and whether it has an enabled endpoint for the type too):

    RunCompleted | RunFailed | RunCanceled  -> run.completed | run.failed | run.canceled
    ApprovalRequested                       -> approval.requested  (subject: the approval)
    ApprovalDecided approved | rejected     -> approval.decided
    ApprovalDecided expired                 -> approval.expired    (canceled: none)
    RunWaiting with a workflow's `request`  -> workflow.waiting
    RunFailed tenant_quota_exceeded         -> also quota.exceeded, once per quota window

A type nobody wants (`Subscriptions`) costs nothing: no statement, no Redis call. After a
commit that wrote a message, one `PUBLISH` on `WAKE_CHANNEL` starts the deliverers at once.
A message holds what the writer knew (small); its body is rendered when it is fanned out
(`webhooks.render`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final, cast

import redis
from sqlalchemy import Table, select

from tracon_jobs.db import Database
from tracon_jobs.db.models import Run
from tracon_jobs.limits.budget_store import QUOTA_EXCEEDED
from tracon_jobs.limits.quota_store import Period, Window, window_of
from tracon_jobs.limits.tenant_quotas import Quotas, quota_json
from tracon_jobs.runs.store import Message, Typed
from tracon_jobs.runs.store.statements import message_insert
from tracon_jobs.tenants import TenantStore
from tracon_jobs.webhooks.events import WAKE_CHANNEL
from tracon_jobs.webhooks.signing import message_id
from tracon_jobs.webhooks.subscriptions import Subscriptions, Wanted

log = logging.getLogger(__name__)

RUNS = cast(Table, Run.__table__)

RUN_EVENTS: Final = {
    "RunCompleted": "run.completed",
    "RunFailed": "run.failed",
    "RunCanceled": "run.canceled",
    "ApprovalRequested": "approval.requested",
}
"""Run events that always become a message of one type (the others depend on their data)."""

DECISIONS: Final = {
    "approved": "approval.decided",
    "rejected": "approval.decided",
    "expired": "approval.expired",
}
"""An `ApprovalDecided`'s outcome -> its message type (a canceled approval tells nobody)."""

KEPT: Final = {
    "run.completed": ("status",),
    "run.failed": ("status", "error"),
    "run.canceled": ("status", "error"),
    "approval.requested": ("approvalId", "tool", "expiresAt"),
    "approval.decided": ("approvalId", "tool", "outcome", "decidedBy", "comment"),
    "approval.expired": ("approvalId", "tool", "outcome"),
    "workflow.waiting": ("request",),
}
"""What a message keeps of its event's data: enough to say what happened; the run's output
and a call's arguments stay in their rows, from which the body is rendered."""

NOTED_KEPT: Final = 10_000
"""Once-only messages (`dedupe_key`) this process knows are written, kept to skip the reads
that would build them again; forgotten all at once beyond this many."""


def message_type(event_type: str, data: dict[str, Any]) -> str | None:
    """The webhook message type a run event becomes, or None."""
    if event_type == "ApprovalDecided":
        return DECISIONS.get(str(data.get("outcome")))
    if event_type == "RunWaiting":
        return "workflow.waiting" if "request" in data else None
    return RUN_EVENTS.get(event_type)


def subject_of(type_: str, run_id: str, data: dict[str, Any]) -> str:
    """What the message is about: the approval of an approval event, else the run."""
    return str(data["approvalId"]) if type_.startswith("approval.") else run_id


def is_quota_failure(event_type: str, data: dict[str, Any]) -> bool:
    error = data.get("error")
    return (
        event_type == "RunFailed"
        and isinstance(error, dict)
        and error.get("type") == QUOTA_EXCEEDED
    )


@dataclass(frozen=True)
class QuotaNotice:
    """A `quota.exceeded` message to write once: its key, and the quota in the API's shape."""

    tenant_id: str
    dedupe_key: str
    data: dict[str, Any]


def quota_key(tenant_id: str, window: Window) -> str:
    return f"quota.exceeded:{tenant_id}:{window.start:%Y-%m-%dT%H:%M:%SZ}"


class QuotaNotices:
    """The data of `quota.exceeded`: the quota as `GET /api/quota` shows it now."""

    def __init__(
        self,
        quotas: Quotas,
        tenants: TenantStore,
        default_max_runs: int | None,
        currency: str,
    ) -> None:
        self.quotas = quotas
        self.tenants = tenants
        self.default_max_runs = default_max_runs
        self.currency = currency

    def key(self, tenant_id: str, period: Period | None = None) -> str:
        """The key of the tenant's current window (`period`: its quota's, when known)."""
        period = period or self.quotas.quota_of(tenant_id).period
        return quota_key(tenant_id, window_of(period))

    def notice(self, tenant_id: str) -> QuotaNotice:
        usage = self.quotas.usage(tenant_id)
        own = self.tenants.max_concurrent_runs(tenant_id)
        max_runs = own if own is not None else self.default_max_runs
        data = quota_json(usage, self.currency, max_runs, self.tenants.weight(tenant_id))
        return QuotaNotice(tenant_id, quota_key(tenant_id, usage.window), data)


class WebhookOutbox:
    """The run store's `Outbox`: the messages events cause, and the wake-up after their
    commit; also the `quota.exceeded` of a submission the web refused."""

    def __init__(
        self,
        db: Database,
        client: redis.Redis,
        subscriptions: Subscriptions,
        quota_notices: QuotaNotices | None = None,
    ) -> None:
        self.db = db
        self.client = client
        self.subscriptions = subscriptions
        self.quota_notices = quota_notices
        self._noted: set[str] = set()  # dedupe keys known to be written
        self._lock = threading.Lock()

    # -- the run store's side -------------------------------------------------------------

    def messages(self, run_id: str, events: Typed) -> list[Message]:
        found: list[Message] = []
        for event_type, data in events:
            type_ = message_type(event_type, data)
            if type_ is None:
                continue  # most events: not even the subscriptions are asked
            wanted = self.subscriptions.current()
            if wanted.wants(type_):
                found.append(_message(wanted, type_, subject_of(type_, run_id, data), data))
            if is_quota_failure(event_type, data) and wanted.wants("quota.exceeded"):
                found.extend(self._quota_message(wanted, run_id))
        return found

    def committed(self, messages: Sequence[Message], wrote: bool) -> None:
        self._note(messages)
        if wrote:
            self.wake(len(messages))

    def _note(self, messages: Sequence[Message]) -> None:
        with self._lock:
            if len(self._noted) > NOTED_KEPT:
                self._noted.clear()
            self._noted.update(m.dedupe_key for m in messages if m.dedupe_key is not None)

    def wake(self, count: int = 1) -> None:
        """One `PUBLISH`: the deliverers look for new messages now (they poll anyway)."""
        try:
            self.client.publish(WAKE_CHANNEL, str(count))
        except redis.RedisError as exc:
            log.warning("webhook deliverers not woken (they poll): %s", exc)

    def _quota_message(self, wanted: Wanted, run_id: str) -> list[Message]:
        """The `quota.exceeded` a run failed for its tenant's quota causes, unless this process
        knows it is written already for the window (the insert's key makes sure anyway)."""
        tenant_id = self._tenant_of(run_id)
        notice = None if tenant_id is None else self._notice(wanted, tenant_id)
        if notice is None:
            return []
        return [_message(wanted, "quota.exceeded", tenant_id or "", notice.data, notice.dedupe_key)]

    def _tenant_of(self, run_id: str) -> str | None:
        with self.db.read() as session:
            return session.scalar(select(RUNS.c.tenant_id).where(RUNS.c.id == run_id))

    def _notice(
        self, wanted: Wanted, tenant_id: str, period: Period | None = None
    ) -> QuotaNotice | None:
        """The tenant's `quota.exceeded` to write, unless nobody wants it or this process
        knows it is written for the window (the quota's reads, then, are not made)."""
        notices = self.quota_notices
        if notices is None or not wanted.wants_of(tenant_id, "quota.exceeded"):
            return None
        if notices.key(tenant_id, period) in self._noted:
            return None
        notice = notices.notice(tenant_id)
        return None if notice.dedupe_key in self._noted else notice

    # -- the web's side ------------------------------------------------------------------

    def quota_refused(self, tenant_id: str, period: Period | None = None) -> bool:
        """A submission of the tenant was refused for its quota (of `period`): write its
        `quota.exceeded` in a transaction of its own, when anyone wants it and it is not
        written yet for the window. Whether a message was written now."""
        wanted = self.subscriptions.current()
        notice = self._notice(wanted, tenant_id, period)
        if notice is None:
            return False
        message = _message(wanted, "quota.exceeded", tenant_id, notice.data, notice.dedupe_key)
        statement = message_insert(
            of_run=False, gated=message.gated, once=True, on_sqlite=self.db.is_sqlite
        )
        now = self.db.now()
        with self.db.write() as session:
            row = session.execute(statement, _params(message, tenant_id, now)).first()
        wrote = row is not None and row[0] == message.id
        if row is not None:
            self.committed([message], wrote)
        return wrote


def _message(
    wanted: Wanted, type_: str, subject_id: str, data: dict[str, Any], dedupe_key: str | None = None
) -> Message:
    kept = KEPT.get(type_)
    small = data if kept is None else {key: data[key] for key in kept if key in data}
    return Message(message_id(), type_, subject_id, small, wanted.gated(type_), dedupe_key)


def _params(message: Message, source_id: str, at: Any) -> dict[str, Any]:
    return {
        "p_id": message.id,
        "p_source_id": source_id,
        "p_type": message.type,
        "p_subject_id": message.subject_id,
        "p_data": message.data,
        "p_dedupe_key": message.dedupe_key,
        "p_created_at": at,
    }
