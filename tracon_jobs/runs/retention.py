"""Run retention: deleting the run history older than `Runs.Retention` (or a tenant's own,
`tracon-jobs tenants retention`), in batches, never a run whose group is live.

The unit is a group (`runs.export`): a run tree with the chain of trees continuations link
to it. A group goes when every run of it is terminal (`Completed`, `Failed`, `Canceled`) and
its last run ended before its tenant's cutoff (`now - retention`); one live run, or one
recent one, keeps the whole group. With it go every row that names its runs: events,
tool-call ledger, workflow checkpoints and requests, the events kept for its chains,
approvals (and their Slack messages), the idempotency records of its submissions, and the
schedule fires that started its runs (a schedule keeps only its newest fires without a run,
`schedules.firing.FIRES_KEPT`, so fires stay bounded either way). Webhook messages name runs
only as text and have a lifecycle of their own: they stay.

A pass (`purge_once`, beat's `tracon.runs.retention` under its lease) goes tenant by tenant
in turn, a batch of each at a time: it reads up to `Runs.RetentionBatch` of the tenant's
oldest ended tree roots (`ix_runs_tenant_ended`), finds each one's group and judges it, with
`Runs.ArchiveDirectory` writes each group that may go to its file, then deletes them in one
short write transaction: the groups' runs are locked (PostgreSQL) and checked again (nothing
continued a group meanwhile), then the child rows go, then the runs, each statement naming at
most `IDS_PER_STATEMENT` run ids through an index. Batches go on until no tenant has any
due, the lease is lost, or the pass's time is up (the next pass goes on where it stopped).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, cast

from sqlalchemy import Delete, Select, Table, and_, delete, func, or_, select
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from tracon_jobs.db import Database
from tracon_jobs.db.models import (
    Approval,
    IdempotencyRecord,
    Run,
    RunEvent,
    ScheduleFire,
    SlackMessage,
    Tenant,
    ToolCallRecord,
    WorkflowEvent,
    WorkflowNode,
)
from tracon_jobs.runs.export import (
    GroupChanged,
    GroupTooLarge,
    RunGroup,
    archive_path,
    chunks,
    find_groups,
    write_archive,
)

log = logging.getLogger(__name__)

RUNS = cast(Table, Run.__table__)
TENANTS = cast(Table, Tenant.__table__)

KEEP_FOREVER = 0
"""A tenant's stored `retention_seconds` that keeps its runs forever, whatever the setting."""

DELETED_TABLES = (
    "slack_messages",
    "approvals",
    "run_events",
    "tool_calls",
    "workflow_nodes",
    "workflow_events",
    "idempotency_records",
    "schedule_fires",
    "runs",
)
"""What a deletion removes, in its order: each table before the ones it refers to."""


@dataclass(frozen=True)
class OwnRetention:
    """A tenant's own retention: `None` keeps its runs forever."""

    retention: timedelta | None


def own_retention(seconds: int | None) -> OwnRetention | None:
    """The tenant's stored override as a value: None when it has none (the setting holds)."""
    if seconds is None:
        return None
    if seconds == KEEP_FOREVER:
        return OwnRetention(None)
    return OwnRetention(timedelta(seconds=seconds))


def stored_seconds(own: OwnRetention) -> int:
    """What `own` is stored as (whole seconds, at least one; `KEEP_FOREVER`)."""
    if own.retention is None:
        return KEEP_FOREVER
    return max(1, int(own.retention.total_seconds()))


@dataclass
class RetentionResult:
    """What one pass did: groups and runs deleted, rows per table, groups kept because they
    were live or ended too recently, archive files written, and whether it finished."""

    enabled: bool
    groups: int = 0
    trees: int = 0
    runs: int = 0
    kept: int = 0
    archived: int = 0
    rows: dict[str, int] = field(default_factory=dict)
    finished: bool = True
    error: str | None = None

    def as_json(self) -> dict[str, Any]:
        return {
            "enabled": self.enabled,
            "groups": self.groups,
            "trees": self.trees,
            "runs": self.runs,
            "kept": self.kept,
            "archived": self.archived,
            "rows": dict(self.rows),
            "finished": self.finished,
            **({"error": self.error} if self.error else {}),
        }


Cursor = tuple[datetime, str]
"""(ended_at, id) of the last root a batch read: the tenant's next batch reads after it."""


@dataclass
class _Batch:
    due: list[RunGroup]
    kept: int
    cursor: Cursor | None  # None: the tenant has no more roots due in this pass


class RunRetention:
    """Deletes run groups past their tenant's retention (`Runs.Retention` or its own)."""

    def __init__(
        self,
        db: Database,
        retention: timedelta | None,
        *,
        batch: int = 200,
        archive_directory: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.db = db
        self.retention = retention
        self.batch = batch
        self.archive_directory = archive_directory
        self.clock = clock

    # -- what is configured ---------------------------------------------------------------

    def own_retentions(self) -> dict[str, OwnRetention]:
        """Every tenant's own retention, by tenant id (tenants without one are left out)."""
        query = select(TENANTS.c.id, TENANTS.c.retention_seconds).where(
            TENANTS.c.retention_seconds.is_not(None)
        )
        with self.db.read() as session:
            rows = session.execute(query).all()
        return {tenant: own for tenant, seconds in rows if (own := own_retention(seconds))}

    def configured(self) -> bool:
        """Whether anything may ever be deleted: `Runs.Retention`, or a tenant's own."""
        if self.retention is not None:
            return True
        return any(own.retention is not None for own in self.own_retentions().values())

    def cutoffs(self, now: datetime) -> dict[str, datetime]:
        """Each tenant whose runs may go, with its cutoff: a group whose last run ended
        before it is deleted. Tenants kept forever are left out."""
        own = self.own_retentions()
        retentions: dict[str, timedelta] = {}
        if self.retention is not None:
            with self.db.read() as session:
                retentions = dict.fromkeys(session.scalars(select(TENANTS.c.id)), self.retention)
        for tenant, override in own.items():
            if override.retention is None:
                retentions.pop(tenant, None)
            else:
                retentions[tenant] = override.retention
        return {tenant: now - retention for tenant, retention in sorted(retentions.items())}

    # -- a pass ----------------------------------------------------------------------------

    def purge_once(
        self,
        now: datetime,
        still_owner: Callable[[], bool] = lambda: True,
        budget: timedelta | None = None,
    ) -> RetentionResult:
        """Delete every group past its retention, batch after batch, the tenants in turn;
        stops early (`finished` False) when `still_owner` turns False or after `budget`."""
        cutoffs = self.cutoffs(now)
        result = RetentionResult(enabled=self.retention is not None or bool(cutoffs))
        deadline = None if budget is None else self.clock() + budget.total_seconds()
        cursors: dict[str, Cursor | None] = dict.fromkeys(cutoffs)
        judged: set[str] = set()  # roots of the groups this pass judged already
        while cursors:
            for tenant in list(cursors):
                if not still_owner() or (deadline is not None and self.clock() >= deadline):
                    result.finished = False
                    return result
                batch = self._read_batch(tenant, cutoffs[tenant], cursors[tenant], judged)
                result.kept += batch.kept
                try:
                    self._delete_batch(batch.due, result)
                except OSError as exc:
                    result.error = f"archive not written: {exc}"
                    result.finished = False
                    log.error("run retention stopped, nothing more deleted: %s", result.error)
                    return result
                if batch.cursor is None:
                    del cursors[tenant]
                else:
                    cursors[tenant] = batch.cursor
        return result

    def _read_batch(
        self, tenant: str, cutoff: datetime, cursor: Cursor | None, judged: set[str]
    ) -> _Batch:
        """The tenant's next roots ended before `cutoff`, oldest first, and the groups of
        them that may go."""
        query = due_roots(tenant, cutoff, cursor, self.batch)
        with self.db.read() as session:
            roots = session.execute(query).all()
            unjudged = [root for root, _ in roots if root not in judged]
            groups = _groups(session, unjudged)
        for group in groups:
            judged.update(group.roots)
        due = [group for group in groups if group.expired(cutoff)]
        next_cursor = (roots[-1][1], roots[-1][0]) if len(roots) == self.batch else None
        return _Batch(due, len(groups) - len(due), next_cursor)

    def _delete_batch(self, due: list[RunGroup], result: RetentionResult) -> None:
        """Archive the groups (with `Runs.ArchiveDirectory`), then delete them in one
        transaction, each checked again under its rows' locks."""
        directory = self.archive_directory
        if directory is not None:
            archived = []
            for group in due:
                try:
                    write_archive(self.db, directory, group)
                except GroupChanged:  # being deleted by another pass: its copy stays
                    continue
                archived.append(group)
            result.kept += len(due) - len(archived)
            due = archived
        if not due:
            return
        with self.db.write() as session:
            ids = sorted(run_id for group in due for run_id in group.ids)
            _lock(session, ids, self.db.is_sqlite)
            changed, whole = _changed(session, due)
            gone = [group for index, group in enumerate(due) if index not in changed]
            if directory is not None:  # a group that lives on whole loses its copy
                for index in changed & whole:
                    archive_path(directory, due[index]).unlink(missing_ok=True)
            counts = delete_runs(session, [run_id for group in gone for run_id in group.ids])
        result.groups += len(gone)
        result.trees += sum(len(group.roots) for group in gone)
        result.runs += counts.get("runs", 0)
        result.archived += len(gone) if self.archive_directory is not None else 0
        for table, count in counts.items():
            result.rows[table] = result.rows.get(table, 0) + count
        result.kept += len(due) - len(gone)


def _lock(session: Session, ids: Sequence[str], sqlite: bool) -> None:
    """PostgreSQL: lock the runs about to go, in id order (two passes never deadlock), so
    that a resume of one of them waits for the deletion, or the check sees its new run.
    SQLite's write transaction holds the whole database already."""
    if sqlite:
        return
    for batch in chunks(ids):
        session.execute(
            select(RUNS.c.id).where(RUNS.c.id.in_(batch)).order_by(RUNS.c.id).with_for_update()
        ).all()


def due_roots(tenant: str, cutoff: datetime, cursor: Cursor | None, limit: int) -> Select[Any]:
    """(id, ended_at) of the tenant's tree roots that ended before `cutoff`, after `cursor`,
    oldest first: a range of `ix_runs_tenant_ended`."""
    query = select(RUNS.c.id, RUNS.c.ended_at).where(
        RUNS.c.tenant_id == tenant,
        RUNS.c.ended_at < cutoff,
        RUNS.c.root_run_id == RUNS.c.id,
    )
    if cursor is not None:
        ended, last = cursor
        query = query.where(
            or_(RUNS.c.ended_at > ended, and_(RUNS.c.ended_at == ended, RUNS.c.id > last))
        )
    return query.order_by(RUNS.c.ended_at, RUNS.c.id).limit(limit)


def _groups(session: Session, roots: list[str]) -> list[RunGroup]:
    """The groups of `roots`, found together; a group too large to delete in one transaction
    is left out (logged), found on its own to tell it from the others."""
    try:
        return find_groups(session, roots)
    except GroupTooLarge:
        pass
    groups: list[RunGroup] = []
    seen: set[str] = set()
    for root in roots:
        if root in seen:
            continue
        try:
            found = find_groups(session, [root])
        except GroupTooLarge as exc:
            log.warning("run retention: tree %s kept: %s", root, exc)
            seen.add(root)
            continue
        for group in found:
            seen.update(group.roots)
            groups.append(group)
    return groups


def _changed(session: Session, groups: Sequence[RunGroup]) -> tuple[set[int], set[int]]:
    """The positions of the groups that are no longer what was judged (a run of theirs gone
    or a run added to their trees, or a run outside them continuing one of their runs: a
    resume meanwhile), and of those whose every run is still there. Two reads a chunk of
    `IDS_PER_STATEMENT` ids, for all of them."""
    group_of_root = {root: index for index, group in enumerate(groups) for root in group.roots}
    group_of_run = {run: index for index, group in enumerate(groups) for run in group.ids}
    expected = Counter(member.root_run_id for group in groups for member in group.members)
    present: Counter[str] = Counter()
    for batch in chunks(sorted(group_of_root)):
        query = (
            select(RUNS.c.root_run_id, func.count())
            .where(RUNS.c.root_run_id.in_(batch))
            .group_by(RUNS.c.root_run_id)
        )
        present.update({root: count for root, count in session.execute(query)})
    changed = {group_of_root[root] for root in group_of_root if present[root] != expected[root]}
    short = {group_of_root[root] for root in group_of_root if present[root] < expected[root]}
    whole = set(range(len(groups))) - short
    for batch in chunks(sorted(group_of_run)):
        query = select(RUNS.c.continued_from_run_id, RUNS.c.root_run_id).where(
            RUNS.c.continued_from_run_id.in_(batch)
        )
        for before, root in session.execute(query):
            if group_of_root.get(root) != group_of_run[before]:
                changed.add(group_of_run[before])
    return changed, whole


def delete_statements(run_ids: Sequence[str]) -> list[tuple[str, Delete]]:
    """The statements that delete the runs (at most `IDS_PER_STATEMENT`) and every row that
    names them, each through an index of the column it names, in `DELETED_TABLES` order."""
    approvals = select(Approval.id).where(Approval.run_id.in_(run_ids))
    return [
        ("slack_messages", delete(SlackMessage).where(SlackMessage.approval_id.in_(approvals))),
        ("approvals", delete(Approval).where(Approval.run_id.in_(run_ids))),
        ("run_events", delete(RunEvent).where(RunEvent.run_id.in_(run_ids))),
        ("tool_calls", delete(ToolCallRecord).where(ToolCallRecord.run_id.in_(run_ids))),
        ("workflow_nodes", delete(WorkflowNode).where(WorkflowNode.run_id.in_(run_ids))),
        ("workflow_events", delete(WorkflowEvent).where(WorkflowEvent.chain_id.in_(run_ids))),
        (
            "idempotency_records",
            delete(IdempotencyRecord).where(IdempotencyRecord.run_id.in_(run_ids)),
        ),
        ("schedule_fires", delete(ScheduleFire).where(ScheduleFire.run_id.in_(run_ids))),
        ("runs", delete(Run).where(Run.id.in_(run_ids))),
    ]


def delete_runs(session: Session, run_ids: Iterable[str]) -> dict[str, int]:
    """Delete the runs and every row that names them, `IDS_PER_STATEMENT` runs per
    statement, in the caller's transaction; rows deleted per table."""
    counts = dict.fromkeys(DELETED_TABLES, 0)
    for batch in chunks(run_ids):
        for table, statement in delete_statements(batch):
            outcome = session.execute(statement.execution_options(synchronize_session=False))
            counts[table] += int(getattr(outcome, "rowcount", 0) or 0)
    return counts


def has_any_retention(retention: RunRetention) -> bool:
    """`configured()`, or True when the database cannot say (beat schedules the pass, which
    finds out at each tick): a missed schedule would keep every run forever unnoticed."""
    try:
        return retention.configured()
    except SQLAlchemyError as exc:
        log.warning("run retention: tenants' own retentions not read (%s); scheduled anyway", exc)
        return True
