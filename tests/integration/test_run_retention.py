"""Run retention (`Runs.Retention`, a tenant's own, beat's `tracon.runs.retention`), the
archive it writes first (`Runs.ArchiveDirectory`) and `tracon-jobs runs export`, on SQLite and
PostgreSQL: exactly the groups past their tenant's retention go, whole (a tree with the chain
of trees continuations link to it), with every row that names their runs; a group with one
live or recent run stays whole; tables stay bounded under a steady load."""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select, update

import beat_schedules
from beat_schedules.schedule import RUN_RETENTION_TASK
from tests.helpers import MakeRuntime, hold_queued
from tracon_jobs.cli import main
from tracon_jobs.db.models import (
    Approval,
    IdempotencyRecord,
    Run,
    RunEvent,
    Schedule,
    ScheduleFire,
    SlackMessage,
    ToolCallRecord,
    WorkflowEvent,
    WorkflowNode,
)
from tracon_jobs.runs import export
from tracon_jobs.runs.retention import OwnRetention, RetentionResult, RunRetention
from tracon_jobs.runs.store import NewRun
from tracon_jobs.runtime import Runtime

DAY = timedelta(days=1)
HOUR = timedelta(hours=1)


# -- building run history ------------------------------------------------------------------


class History:
    """Runs with every kind of row that names a run, at the times a test gives them."""

    def __init__(self, runtime: Runtime) -> None:
        self.rt = runtime
        self.now = runtime.db.now()

    def tenant(self, name: str) -> str:
        return self.rt.tenants.ensure_tenant(name)

    def run(
        self,
        tenant: str,
        *,
        ended: timedelta | None,
        status: str = "Completed",
        parent: str | None = None,
        root: str | None = None,
        continues: str | None = None,
        kind: str = "agent",
    ) -> str:
        """A run that ended `ended` ago (None: still `status`, not ended), with its rows."""
        new = NewRun(
            tenant,
            "demo",
            {"message": "hi"},
            kind=kind,
            parent_run_id=parent,
            root_run_id=root,
            depth=0 if parent is None else 1,
            continued_from_run_id=continues,
        )
        run_id = self.rt.runs.create(new).id
        created = self.now - (ended or timedelta(0)) - HOUR
        with self.rt.db.write() as session:
            session.execute(
                update(Run)
                .where(Run.id == run_id)
                .values(
                    status=status,
                    created_at=created,
                    ended_at=None if ended is None else self.now - ended,
                )
            )
            self._rows(session, tenant, run_id, created)
        return run_id

    def tree(self, tenant: str, *, ended: timedelta, live_child: bool = False, **kw: Any) -> str:
        """A root with two children; with `live_child`, the second is still `Running`."""
        root = self.run(tenant, ended=ended, **kw)
        self.run(tenant, ended=ended, parent=root, root=root)
        if live_child:
            self.run(tenant, ended=None, status="Running", parent=root, root=root)
        else:
            self.run(tenant, ended=ended + HOUR, parent=root, root=root)
        return root

    def _rows(self, session: Any, tenant: str, run_id: str, at: datetime) -> None:
        approval = str(uuid.uuid4())
        call = {"turn": 1, "call_id": "c1", "tool": "lookup", "arguments": {}, "args_hash": "h"}
        session.add_all(
            [
                ToolCallRecord(
                    run_id=run_id,
                    **call,
                    execution_id=str(uuid.uuid4()),
                    idempotency_key=f"{run_id}:1:c1",
                    status="succeeded",
                    result={"value": 1},
                    started_at=at,
                    ended_at=at,
                ),
                Approval(
                    id=approval,
                    tenant_id=tenant,
                    run_id=run_id,
                    **call,
                    execution_id=str(uuid.uuid4()),
                    status="Approved",
                    requested_at=at,
                    expires_at=at + DAY,
                ),
                WorkflowNode(
                    run_id=run_id,
                    node="step:1",
                    kind="step",
                    status="completed",
                    result={"value": 2},
                    created_at=at,
                ),
                WorkflowEvent(tenant_id=tenant, chain_id=run_id, name="paid", created_at=at),
                IdempotencyRecord(
                    tenant_id=tenant,
                    key=f"key-{run_id}",
                    method="POST",
                    path="/api/agents/demo/run",
                    fingerprint="f",
                    state="Completed",
                    run_id=run_id,
                    created_at=at,
                ),
            ]
        )
        session.flush()
        session.add(SlackMessage(approval_id=approval, channel="C1", ts="1.0", posted_at=at))
        session.add(self._schedule(tenant, run_id, at))
        session.flush()
        session.add(
            ScheduleFire(
                schedule_id=run_id, slot_at=at, tenant_id=tenant, outcome="fired", run_id=run_id,
                fired_at=at,
            )
        )  # fmt: skip

    @staticmethod
    def _schedule(tenant: str, run_id: str, at: datetime) -> Schedule:
        """A schedule whose one fire started the run (named after it: one per run)."""
        return Schedule(
            id=run_id, tenant_id=tenant, name=f"s-{run_id}", cron=None, timezone="UTC",
            interval_ms=60_000, anchor_at=at, target_kind="agent", target_name="demo",
            input={"message": "hi"}, overlap="skip", catch_up="none", paused=False,
            created_at=at, updated_at=at,
        )  # fmt: skip

    def group(self, root: str) -> list[str]:
        """The ids of the root's group as the export finds it."""
        from tracon_jobs.runs.export import group_of_run

        group = group_of_run(self.rt.db, root)
        assert group is not None
        return group.ids


ROW_TABLES: dict[str, Any] = {
    "runs": Run.id,
    "run_events": RunEvent.run_id,
    "tool_calls": ToolCallRecord.run_id,
    "approvals": Approval.run_id,
    "workflow_nodes": WorkflowNode.run_id,
    "workflow_events": WorkflowEvent.chain_id,
    "idempotency_records": IdempotencyRecord.run_id,
    "schedule_fires": ScheduleFire.run_id,
}


def rows_naming(rt: Runtime, run_ids: list[str]) -> dict[str, int]:
    """How many rows of each table name one of the runs."""
    with rt.db.read() as session:
        counts = {
            table: session.scalar(select(func.count()).where(column.in_(run_ids))) or 0
            for table, column in ROW_TABLES.items()
        }
        approvals = select(Approval.id).where(Approval.run_id.in_(run_ids))
        counts["slack_messages"] = (
            session.scalar(select(func.count()).where(SlackMessage.approval_id.in_(approvals))) or 0
        )
    return counts


def run_count(rt: Runtime) -> int:
    with rt.db.read() as session:
        return session.scalar(select(func.count()).select_from(Run)) or 0


# -- what goes and what stays --------------------------------------------------------------


@pytest.fixture
def retained(make_runtime: MakeRuntime, sql_url: str, tmp_path: Path) -> Runtime:
    """A runtime keeping runs a day, archiving what it deletes under `tmp_path/archive`."""
    return make_runtime(
        sql_url,
        sender=hold_queued,
        Runs={"Retention": "1.00:00:00", "ArchiveDirectory": str(tmp_path / "archive")},
    )


def test_retention_deletes_exactly_the_old_terminal_groups_with_every_row_naming_them(
    retained: Runtime, tmp_path: Path
) -> None:
    rt = retained
    h = History(rt)
    acme, patient, forever = h.tenant("acme"), h.tenant("patient"), h.tenant("forever")
    rt.tenants.set_retention(patient, OwnRetention(timedelta(days=30)))
    rt.tenants.set_retention(forever, OwnRetention(None))

    old = h.tree(acme, ended=2 * DAY)
    old_but_live = h.tree(acme, ended=2 * DAY, live_child=True)
    recent = h.tree(acme, ended=HOUR)
    longer_override = h.tree(patient, ended=2 * DAY)
    kept_forever = h.tree(forever, ended=30 * DAY)
    # a workflow chain whose last run is recent: every run of it stays
    first = h.run(acme, ended=3 * DAY, kind="workflow")
    second = h.run(acme, ended=2 * DAY, kind="workflow", continues=first)
    h.run(acme, ended=HOUR, kind="workflow", continues=second)
    # a chain whose last run still waits for a person
    asking = h.run(acme, ended=3 * DAY, kind="workflow")
    h.run(acme, ended=None, status="Waiting", kind="workflow", continues=asking)
    # a chain that ended long ago, over two trees: it goes whole
    old_chain = h.tree(acme, ended=3 * DAY, kind="workflow")
    h.tree(acme, ended=2 * DAY, kind="workflow", continues=old_chain)

    chain = h.group(old_chain)
    doomed = h.group(old) + chain
    kept = [
        run_id
        for root in (old_but_live, recent, longer_override, kept_forever, first, asking)
        for run_id in h.group(root)
    ]
    assert len(doomed) == 9 and len(kept) == 17 and run_count(rt) == 26
    before = rows_naming(rt, kept)

    result = rt.run_retention.purge_once(rt.db.now())

    assert result.enabled and result.finished and result.error is None
    assert (result.groups, result.trees, result.runs, result.archived) == (2, 3, 9, 2)
    assert rows_naming(rt, doomed) == dict.fromkeys([*ROW_TABLES, "slack_messages"], 0)
    assert rows_naming(rt, kept) == before
    assert run_count(rt) == 17
    assert result.rows == dict.fromkeys([*ROW_TABLES, "slack_messages"], 9)  # one of each a run

    # the archive holds each deleted group, named after its first run, and parses
    archive = tmp_path / "archive"
    assert sorted(p.name for p in archive.iterdir()) == sorted(
        [f"{old}.jsonl", f"{old_chain}.jsonl"]
    )
    lines = [json.loads(line) for line in (archive / f"{old_chain}.jsonl").read_text().splitlines()]
    assert [line["id"] for line in lines if line["type"] == "run"] == chain
    assert len(chain) == 6 and lines[0]["type"] == "run" and lines[0]["id"] == old_chain
    assert {line["type"] for line in lines} == {
        "run",
        "event",
        "toolCall",
        "workflowNode",
        "approval",
        "workflowEvent",
    }

    # nothing more is due: a second pass deletes nothing
    again = rt.run_retention.purge_once(rt.db.now())
    assert (again.groups, again.runs, again.kept) == (0, 0, result.kept)


def test_a_pass_goes_on_batch_after_batch_and_stops_when_the_lease_or_its_time_ends(
    make_runtime: MakeRuntime, sql_url: str
) -> None:
    rt = make_runtime(
        sql_url, sender=hold_queued, Runs={"Retention": "01:00:00", "RetentionBatch": 2}
    )
    h = History(rt)
    acme, other = h.tenant("acme"), h.tenant("other")
    for _ in range(5):
        h.tree(acme, ended=2 * HOUR)
    h.tree(other, ended=2 * HOUR)

    lost = rt.run_retention.purge_once(rt.db.now(), still_owner=lambda: False)
    assert (lost.finished, lost.groups) == (False, 0)

    ticks = iter(range(100))
    rt.run_retention.clock = lambda: float(next(ticks))
    timed = rt.run_retention.purge_once(rt.db.now(), budget=timedelta(seconds=2))
    assert timed.finished is False and 0 < timed.groups < 6  # two batches in its time

    rt.run_retention.clock = time.monotonic
    rest = rt.run_retention.purge_once(rt.db.now())
    assert rest.finished and timed.groups + rest.groups == 6 and run_count(rt) == 0


def test_an_unwritable_archive_deletes_nothing(
    make_runtime: MakeRuntime, sql_url: str, tmp_path: Path
) -> None:
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    rt = make_runtime(
        sql_url,
        sender=hold_queued,
        Runs={"Retention": "01:00:00", "ArchiveDirectory": str(blocked / "archive")},
    )
    h = History(rt)
    h.tree(h.tenant("acme"), ended=2 * HOUR)

    result = rt.run_retention.purge_once(rt.db.now())

    assert result.error and result.groups == 0 and not result.finished
    assert run_count(rt) == 3


def test_a_run_continued_after_it_was_judged_keeps_its_group(
    make_runtime: MakeRuntime, sql_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A `workflows resume` of an old Failed run between the read and the delete."""
    rt = make_runtime(sql_url, sender=hold_queued, Runs={"Retention": "01:00:00"})
    h = History(rt)
    acme = h.tenant("acme")
    failed = h.run(acme, ended=2 * HOUR, status="Failed", kind="workflow")
    retention = rt.run_retention
    read = retention._read_batch

    def resumed_meanwhile(*args: Any) -> Any:
        batch = read(*args)
        h.run(acme, ended=None, status="Queued", kind="workflow", continues=failed)
        return batch

    monkeypatch.setattr(retention, "_read_batch", resumed_meanwhile)
    result = retention.purge_once(rt.db.now())

    assert (result.groups, result.kept) == (0, 1) and run_count(rt) == 2


def test_a_pass_overlapping_another_keeps_the_others_archive_and_deletes_nothing_twice(
    make_runtime: MakeRuntime, sql_url: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Two passes at once (`SingletonExecution` off, a slow pass): the second judged the
    group before the first deleted it."""
    archive = tmp_path / "archive"
    runs = {"Retention": "01:00:00", "ArchiveDirectory": str(archive)}
    rt = make_runtime(sql_url, sender=hold_queued, Runs=runs)
    h = History(rt)
    root = h.tree(h.tenant("acme"), ended=2 * HOUR)
    first = RunRetention(rt.db, HOUR, archive_directory=str(archive))
    second = rt.run_retention
    read = second._read_batch
    done: list[RetentionResult] = []

    def overtaken(*args: Any) -> Any:
        batch = read(*args)
        done.append(first.purge_once(rt.db.now()))
        return batch

    monkeypatch.setattr(second, "_read_batch", overtaken)
    result = second.purge_once(rt.db.now())

    assert (done[0].groups, done[0].runs) == (1, 3)
    assert (result.groups, result.runs, result.error) == (0, 0, None) and run_count(rt) == 0
    lines = [json.loads(line) for line in (archive / f"{root}.jsonl").read_text().splitlines()]
    assert sum(line["type"] == "run" for line in lines) == 3


def test_a_group_too_large_for_one_transaction_is_kept_and_the_others_go(
    make_runtime: MakeRuntime, sql_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    rt = make_runtime(sql_url, sender=hold_queued, Runs={"Retention": "01:00:00"})
    h = History(rt)
    acme = h.tenant("acme")
    small = h.tree(acme, ended=3 * HOUR)
    large = h.tree(acme, ended=2 * HOUR, kind="workflow")
    h.tree(acme, ended=2 * HOUR, kind="workflow", continues=large)
    monkeypatch.setattr(export, "MAX_GROUP_RUNS", 4)

    result = rt.run_retention.purge_once(rt.db.now())

    assert (result.groups, result.runs) == (1, 3) and run_count(rt) == 6
    assert rows_naming(rt, [small])["runs"] == 0 and rows_naming(rt, [large])["runs"] == 1


# -- without retention, and the per-tenant override -----------------------------------------


def test_without_any_retention_nothing_is_deleted_and_nothing_is_scheduled(
    make_runtime: MakeRuntime, sql_url: str
) -> None:
    rt = make_runtime(sql_url, sender=hold_queued)
    h = History(rt)
    acme = h.tenant("acme")
    h.tree(acme, ended=3650 * DAY)

    assert not rt.run_retention.configured()
    assert rt.run_retention.purge_once(rt.db.now()).as_json()["enabled"] is False
    assert run_count(rt) == 3
    beat_schedules.install(rt.celery, rt)
    assert RUN_RETENTION_TASK not in [e["task"] for e in rt.celery.conf.beat_schedule.values()]


def test_a_tenant_override_alone_schedules_the_pass_and_deletes_only_that_tenants_runs(
    make_runtime: MakeRuntime, sql_url: str
) -> None:
    rt = make_runtime(sql_url, sender=hold_queued)
    h = History(rt)
    acme, other = h.tenant("acme"), h.tenant("other")
    gone = h.tree(acme, ended=2 * HOUR)
    stays = h.tree(other, ended=3650 * DAY)
    rt.tenants.set_retention(acme, OwnRetention(HOUR))

    beat_schedules.install(rt.celery, rt)
    schedule = rt.celery.conf.beat_schedule["delete-runs-past-retention"]
    assert schedule["task"] == RUN_RETENTION_TASK and schedule["schedule"] == 600
    outcome = rt.celery.tasks[RUN_RETENTION_TASK]()  # the beat tick, in the lease owner

    assert outcome["enabled"] and outcome["groups"] == 1 and outcome["finished"]
    assert rows_naming(rt, [gone])["runs"] == 0 and rows_naming(rt, [stays])["runs"] == 1


# -- tables stay bounded under a steady load -------------------------------------------------

TREES_PER_TICK = 3
TICK = timedelta(minutes=10)
HOURS = 5


def test_tables_stay_bounded_under_a_steady_load(make_runtime: MakeRuntime, sql_url: str) -> None:
    """Trees end at a steady rate over several simulated hours, with a 1-hour retention and a
    pass every 10 minutes: the tables never hold more than about an hour and a tick of them."""
    rt = make_runtime(sql_url, sender=hold_queued, Runs={"Retention": "01:00:00"})
    h = History(rt)
    acme = h.tenant("acme")
    start = rt.db.now()
    ticks_per_hour = HOUR // TICK
    per_tick_runs = TREES_PER_TICK * 3
    bound = (ticks_per_hour + 1) * per_tick_runs  # an hour's worth, and the tick being judged
    peaks: list[int] = []
    for tick in range(HOURS * ticks_per_hour):
        clock = start + tick * TICK
        h.now = clock
        for _ in range(TREES_PER_TICK):
            h.tree(acme, ended=timedelta(0))
        rt.run_retention.purge_once(clock)
        peaks.append(run_count(rt))

    created = HOURS * ticks_per_hour * per_tick_runs
    assert created == 270 and max(peaks) <= bound
    assert peaks[-1] == peaks[-7] and peaks[-1] >= ticks_per_hour * per_tick_runs  # steady
    with rt.db.read() as session:
        events = session.scalar(select(func.count()).select_from(RunEvent)) or 0
    assert events == peaks[-1]  # one event per run kept, none of the deleted ones


# -- the command line ----------------------------------------------------------------------


@pytest.fixture
def cli(
    make_runtime: MakeRuntime,
    sqlite_url: str,
    redis_url: str,
    write_config: Callable[..., Path],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> Iterator[Runtime]:
    """A runtime, and `tracon-jobs` reading the same database and Redis (no retention set)."""
    for name in [n for n in os.environ if n.upper().startswith("TRACON")]:
        monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
    path = write_config(Database={"Url": sqlite_url}, Redis={"Url": redis_url})
    monkeypatch.setenv("TRACON_CONFIG", str(path))
    yield make_runtime(sqlite_url, sender=hold_queued)


def test_runs_export_writes_the_tree_and_chain_as_json_lines(
    cli: Runtime, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    h = History(cli)
    acme = h.tenant("acme")
    root = h.tree(acme, ended=2 * DAY, kind="workflow")
    later = h.tree(acme, ended=DAY, kind="workflow", continues=root)
    child = h.group(later)[1]
    capsys.readouterr()

    assert main(["runs", "export", child, "--tenant", "acme"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]

    runs = [line for line in lines if line["type"] == "run"]
    assert [run["id"] for run in runs] == h.group(root)
    assert (
        runs[0]["id"] == root and runs[3]["id"] == later and runs[3]["continuedFromRunId"] == root
    )
    assert runs[0]["tenant"] == "acme" and runs[0]["status"] == "Completed"
    assert lines[1] == {
        "type": "event",
        "runId": root,
        "seq": 1,
        "event": "RunQueued",
        "at": lines[1]["at"],
        "data": lines[1]["data"],
    }
    per_run = [line["type"] for line in lines[: lines.index(runs[1])]]
    assert per_run == ["run", "event", "toolCall", "workflowNode", "approval", "workflowEvent"]

    out = tmp_path / "tree.jsonl"
    assert main(["runs", "export", root, "--output", str(out)]) == 0
    assert [json.loads(line) for line in out.read_text().splitlines()] == lines
    assert capsys.readouterr().out == f"wrote {len(lines)} lines to {out}: 6 runs in 2 trees\n"
    assert main(["runs", "export", root, "--tenant", "nobody"]) == 1
    assert main(["runs", "export", "no-such-run"]) == 1


def test_tenants_retention_shows_sets_and_clears_the_override(
    cli: Runtime, capsys: pytest.CaptureFixture[str]
) -> None:
    acme = cli.tenants.ensure_tenant("acme")
    capsys.readouterr()

    assert main(["tenants", "retention", "acme"]) == 0
    assert capsys.readouterr().out == "tenant 'acme': ended runs kept forever (Runs.Retention)\n"

    assert main(["tenants", "retention", "acme", "90.00:00:00"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(
        "tenant 'acme': ended runs deleted 90.00:00:00 after their tree's last run ended (own)\n"
    )
    assert "restart beat" in out  # no Runs.Retention: beat may not have scheduled the pass
    assert cli.tenants.retention(acme) == OwnRetention(timedelta(days=90))

    assert main(["tenants", "retention", "acme", "never"]) == 0
    assert capsys.readouterr().out == "tenant 'acme': ended runs kept forever (own)\n"
    assert cli.tenants.retention(acme) == OwnRetention(None)

    assert main(["tenants", "retention", "acme", "--clear"]) == 0
    assert "(Runs.Retention)" in capsys.readouterr().out
    assert cli.tenants.retention(acme) is None

    assert main(["tenants", "retention", "acme", "3600", "--clear"]) == 1
    with pytest.raises(SystemExit) as refused:
        main(["tenants", "retention", "acme", "0.5"])
    assert refused.value.code == 2
    assert "at least 1 second" in capsys.readouterr().err
