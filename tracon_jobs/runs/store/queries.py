"""The run store's reads: a run, its events, pages of runs, a tree, a tenant's statistics."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from sqlalchemy import (
    and_,
    func,
    or_,
    select,
)

from tracon_jobs.db import Database
from tracon_jobs.db.models import Run, RunEvent
from tracon_jobs.runs.lifecycle import RunStatus
from tracon_jobs.runs.store.statements import (
    _EVENTS_AFTER,
    _RUN_BY_ID,
    _RUN_OF_TENANT,
    _RUNS_BY_ID,
    _detached_run,
)
from tracon_jobs.runs.store.values import (
    Event,
    ModelUsage,
    RunFilter,
    RunStatistics,
)


class RunQueries:
    """Reads of runs and their events for the API, the console and the command line."""

    db: Database

    def get(self, run_id: str, tenant_id: str | None = None) -> Run | None:
        """The run (detached, every column loaded), or None when it is not there or not the
        tenant's. Core: the row made a `Run` as the claim makes one (`_detached_run`)."""
        with self.db.read_connection() as connection:
            row = connection.execute(_RUN_BY_ID, {"p_id": run_id}).one_or_none()
        if row is None or (tenant_id is not None and row.tenant_id != tenant_id):
            return None
        return _detached_run(row._asdict())

    def get_many(self, run_ids: Sequence[str], tenant_id: str) -> dict[str, Run]:
        """The tenant's runs among `run_ids`, by id, in one read (as `get` builds each); an id
        that is not there, or not the tenant's, is missing from the answer."""
        if not run_ids:
            return {}
        with self.db.read_connection() as connection:
            rows = connection.execute(_RUNS_BY_ID, {"p_ids": list(set(run_ids))}).all()
        return {row.id: _detached_run(row._asdict()) for row in rows if row.tenant_id == tenant_id}

    def exists(self, run_id: str, tenant_id: str) -> bool:
        """Whether the tenant has this run: one indexed read, no row loaded."""
        with self.db.read_connection() as connection:
            return (
                connection.execute(_RUN_OF_TENANT, {"p_id": run_id, "p_tenant": tenant_id}).first()
                is not None
            )

    def events(self, run_id: str, after_seq: int = 0, limit: int = 1000) -> list[Event]:
        """A page of the run's events after `after_seq` (Core: every live stream's read)."""
        params = {"p_id": run_id, "p_after": after_seq, "p_limit": limit}
        with self.db.read_connection() as connection:
            rows = connection.execute(_EVENTS_AFTER, params).all()
        return [Event(run_id, seq, type_, at, data) for seq, type_, at, data in rows]

    def page(
        self, tenant_id: str, filters: RunFilter, *, limit: int, before: tuple[datetime, str] | None
    ) -> list[Run]:
        """Newest first; `before` is the (created_at, id) of the last row of the prior page."""
        query = select(Run).where(Run.tenant_id == tenant_id)
        if filters.status:
            query = query.where(Run.status == filters.status)
        if filters.agent:
            query = query.where(Run.agent == filters.agent)
        if filters.session_id:
            query = query.where(Run.session_id == filters.session_id)
        if filters.kind:
            query = query.where(Run.kind == filters.kind)
        if before is not None:
            created, run_id = before
            query = query.where(
                or_(Run.created_at < created, and_(Run.created_at == created, Run.id < run_id))
            )
        query = query.order_by(Run.created_at.desc(), Run.id.desc()).limit(limit)
        with self.db.read() as session:
            return list(session.scalars(query))

    def tree(self, root_run_id: str, tenant_id: str) -> list[Run]:
        query = (
            select(Run)
            .where(Run.root_run_id == root_run_id, Run.tenant_id == tenant_id)
            .order_by(Run.depth, Run.created_at)
        )
        with self.db.read() as session:
            return list(session.scalars(query))

    def parked(self, tenant_id: str) -> dict[str, int]:
        """A tenant's parked runs by reason: `Queued` runs whose last event is `RunParked`
        (a `RunResumed` after it: sent again, no longer parked). A run held back by its
        tenant's concurrency limit writes no event, so it is not among them."""
        query = (
            select(RunEvent.data)
            .join(Run, (RunEvent.run_id == Run.id) & (RunEvent.seq == Run.event_seq))
            .where(
                Run.tenant_id == tenant_id,
                Run.status == RunStatus.QUEUED.value,
                RunEvent.type == "RunParked",
            )
        )
        reasons: dict[str, int] = {}
        with self.db.read() as session:
            for data in session.scalars(query):
                reason = str((data or {}).get("reason") or "unknown")
                reasons[reason] = reasons.get(reason, 0) + 1
        return dict(sorted(reasons.items()))

    def statistics(self, tenant_id: str, agent: str | None = None) -> RunStatistics:
        """A tenant's runs (of one agent when named) counted per status, and their runs,
        tokens and cost per model that answered, ordered by model."""
        filters = [Run.tenant_id == tenant_id]
        if agent:
            filters.append(Run.agent == agent)
        by_status = select(Run.status, func.count()).where(*filters).group_by(Run.status)
        by_model = (
            select(
                Run.model_id,
                func.count(),
                func.sum(Run.input_tokens),
                func.sum(Run.output_tokens),
                func.sum(Run.cost_amount),
            )
            .where(*filters)
            .group_by(Run.model_id)
            .order_by(Run.model_id)
        )
        with self.db.read() as session:
            statuses = {status: count for status, count in session.execute(by_status)}
            rows = session.execute(by_model).all()
        return RunStatistics(
            statuses,
            [
                ModelUsage(model, runs, int(inputs or 0), int(outputs or 0), float(cost or 0))
                for model, runs, inputs, outputs, cost in rows
            ],
        )
