"""The webhook outbox over real SQL (both backends) and Redis: each state change that a webhook
event tells of writes exactly one message, in the change's own transaction (a lost fence, a
rollback or a killed process writes none); only tenants with an enabled endpoint for the type
get one; nobody listening costs no statement and no Redis command; the subscriptions follow
`CHANGED_CHANNEL` at once and the poll otherwise; `quota.exceeded` once a window; circuits'
moves from Redis, once each however many processes move them; bodies in the API's shapes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import redis
import sqlalchemy as sa
from flask.testing import FlaskClient

from tests import tools
from tests.helpers import (
    MakeRuntime,
    Script,
    auth,
    claim_run,
    run_of,
    scripted_agent,
    wait_until,
)
from tracon_jobs.db import Database
from tracon_jobs.db.models import Run, WebhookEndpoint, WebhookMessage
from tracon_jobs.resilience.breaker import BreakerPolicy, RedisBreakerStore
from tracon_jobs.runs.cancel import cancel_tree
from tracon_jobs.runs.lifecycle import RunStatus
from tracon_jobs.runs.store import NewRun
from tracon_jobs.runtime import Runtime
from tracon_jobs.settings import Settings
from tracon_jobs.webhooks.circuits import TRANSITIONS_KEY, transitions_key
from tracon_jobs.webhooks.events import WAKE_CHANNEL
from tracon_jobs.webhooks.render import render
from tracon_jobs.webhooks.subscriptions import (
    MemorySubscriptions,
    RedisSubscriptions,
    Wanted,
    changed,
)
from web import create_app

ROOT = Path(__file__).resolve().parents[2]
ANSWER: Script = [{"Text": "It shipped."}]
CLOSE_THEN_ANSWER: Script = [
    {"ToolCalls": [{"Name": "close_account", "Arguments": {"account": "acc-1"}}]},
    {"Text": "Done."},
]
RUN_EVENTS = ["run.completed", "run.failed", "run.canceled"]
APPROVAL_EVENTS = ["approval.requested", "approval.decided", "approval.expired"]


@pytest.fixture(autouse=True)
def _clean_tool_records(monkeypatch: pytest.MonkeyPatch) -> None:
    tools.calls.clear()
    # the operator's endpoint's secret, read as a runtime starts (its processes inherit it)
    monkeypatch.setenv("OPS_SECRET", "whsec_" + "b3BlcmF0b3Itc2VjcmV0LWZvci10ZXN0cw==")


def runtime_for(
    make_runtime: MakeRuntime, sql_url: str, script: Script = ANSWER, **sections: Any
) -> Runtime:
    config = scripted_agent(script, ["close_account", "render_audio"])
    config["WorkflowModules"] = ["tests.workflows"]
    config.setdefault("Workflows", {"EnableCheckpointing": True})
    config.update(sections)
    return make_runtime(sql_url, sender=lambda _run_id: None, **config)


def endpoint(runtime: Runtime, tenant: str, events: list[str], *, enabled: bool = True) -> str:
    """An endpoint of `tenant` (as the API would write it), and every process told."""
    now = runtime.db.now()
    row = WebhookEndpoint(
        id=str(uuid.uuid4()),
        tenant_id=runtime.tenants.ensure_tenant(tenant),
        url="https://receiver.example/hook",
        events=events,
        secret="whsec_" + "A" * 32,
        enabled=enabled,
        created_at=now,
        updated_at=now,
    )
    with runtime.db.write() as session:
        session.add(row)
    runtime.subscriptions.changed()
    return row.id


def messages(runtime: Runtime) -> list[WebhookMessage]:
    with runtime.db.read() as session:
        query = sa.select(WebhookMessage).order_by(WebhookMessage.created_at, WebhookMessage.id)
        return list(session.scalars(query))


def told(runtime: Runtime) -> list[tuple[str, str | None, str | None]]:
    """(type, tenant, subject) of every message, oldest first."""
    return [(m.type, m.tenant_id, m.subject_id) for m in messages(runtime)]


def submit(
    runtime: Runtime,
    tenant: str = "acme",
    agent: str = "demo",
    input: dict[str, Any] | None = None,
    **fields: Any,
) -> str:
    tenant_id = runtime.tenants.ensure_tenant(tenant)
    new = NewRun(tenant_id, agent, input or {"message": "go"}, **fields)
    return runtime.runs.create(new).id


def run_count(runtime: Runtime) -> int:
    with runtime.db.read() as session:
        return int(session.scalar(sa.select(sa.func.count()).select_from(Run)) or 0)


def event_at(runtime: Runtime, run_id: str, type_: str) -> datetime:
    [at] = [event.at for event in runtime.runs.events(run_id) if event.type == type_]
    return at


# -- which state changes write which messages ---------------------------------------------


def test_a_completed_run_writes_one_run_completed_in_its_final_write(
    make_runtime: MakeRuntime, sql_url: str
) -> None:
    runtime = runtime_for(make_runtime, sql_url)
    acme = runtime.tenants.ensure_tenant("acme")
    endpoint(runtime, "acme", RUN_EVENTS)
    run_id = submit(runtime)

    assert runtime.executor.execute(run_id) == "Completed"

    [message] = messages(runtime)
    assert (message.type, message.tenant_id, message.subject_id) == ("run.completed", acme, run_id)
    assert message.id.startswith("msg_") and len(message.id) == 30
    assert message.created_at == event_at(runtime, run_id, "RunCompleted")
    assert message.data == {"status": "Completed"}  # the output stays in the run's row
    assert (message.body, message.fanned_at, message.dedupe_key) == (None, None, None)


def test_a_failed_and_a_canceled_run_write_theirs(make_runtime: MakeRuntime, sql_url: str) -> None:
    runtime = runtime_for(make_runtime, sql_url, [{"ErrorStatus": 400}])
    acme = runtime.tenants.ensure_tenant("acme")
    endpoint(runtime, "acme", RUN_EVENTS)
    failed, canceled = submit(runtime), submit(runtime)

    assert runtime.executor.execute(failed) == "Failed"
    assert runtime.runs.cancel_queued(canceled)

    assert told(runtime) == [("run.failed", acme, failed), ("run.canceled", acme, canceled)]
    error = messages(runtime)[0].data["error"]
    assert error["class"] == "Provider" and error["type"] == run_of(runtime, failed).error_type


def test_approvals_requested_decided_and_expired_write_theirs(
    make_runtime: MakeRuntime, sql_url: str
) -> None:
    runtime = runtime_for(
        make_runtime, sql_url, CLOSE_THEN_ANSWER, Approvals={"Timeout": "00:00:02"}
    )
    acme = runtime.tenants.ensure_tenant("acme")
    endpoint(runtime, "acme", APPROVAL_EVENTS)
    decided_run, expiring_run = submit(runtime), submit(runtime)
    assert runtime.executor.execute(decided_run) == "Waiting"
    assert runtime.executor.execute(expiring_run) == "Waiting"
    [decided] = runtime.approval_store.pending_ids(decided_run)
    [expiring] = runtime.approval_store.pending_ids(expiring_run)

    runtime.approvals.decide(acme, decided, True, "fine", "key:test")
    expires_at = runtime.approval_store.get(expiring).expires_at  # type: ignore[union-attr]
    wait_until(lambda: runtime.db.now() > expires_at, what="the expiry", timeout=10)
    expired = runtime.approvals.expire_once(runtime.db.now())

    assert [e.approval.id for e in expired] == [expiring]
    assert told(runtime) == [
        ("approval.requested", acme, decided),
        ("approval.requested", acme, expiring),
        ("approval.decided", acme, decided),
        ("approval.expired", acme, expiring),
    ]
    assert messages(runtime)[2].data == {
        "approvalId": decided,
        "tool": "close_account",
        "outcome": "approved",
        "decidedBy": "key:test",
        "comment": "fine",
    }


def test_a_canceled_approval_tells_nobody_its_run_canceled_does(
    make_runtime: MakeRuntime, sql_url: str
) -> None:
    runtime = runtime_for(make_runtime, sql_url, CLOSE_THEN_ANSWER)
    acme = runtime.tenants.ensure_tenant("acme")
    run_id = submit(runtime)
    assert runtime.executor.execute(run_id) == "Waiting"
    endpoint(runtime, "acme", [*APPROVAL_EVENTS, *RUN_EVENTS])

    cancel_tree(runtime.runs, runtime.cancel_bus, runtime.approval_store, run_of(runtime, run_id))

    assert run_of(runtime, run_id).status == "Canceled"
    assert told(runtime) == [("run.canceled", acme, run_id)]


def test_a_workflow_that_asks_writes_workflow_waiting(
    make_runtime: MakeRuntime, sql_url: str
) -> None:
    runtime = runtime_for(make_runtime, sql_url)
    acme = runtime.tenants.ensure_tenant("acme")
    endpoint(runtime, "acme", ["workflow.waiting", "run.completed"])
    run_id = submit(runtime, agent="review", input={"orderId": "A-1"}, kind="workflow")

    assert runtime.executor.execute(run_id) == "Waiting"

    [child] = [r.id for r in runtime.runs.tree(run_id, acme) if r.id != run_id]
    assert told(runtime) == [("run.completed", acme, child), ("workflow.waiting", acme, run_id)]
    message = messages(runtime)[1]
    assert message.data == {"request": "approve-reply#1"}
    assert message.created_at == event_at(runtime, run_id, "RunWaiting")


def test_answers_in_bulk_write_each_run_the_messages_one_answer_writes(
    make_runtime: MakeRuntime, sql_url: str
) -> None:
    runtime = runtime_for(make_runtime, sql_url)
    acme = runtime.tenants.ensure_tenant("acme")
    endpoint(runtime, "acme", ["run.completed"])
    runs = []
    for n in range(3):
        run_id = submit(runtime, agent="review", input={"orderId": f"A-{n}"}, kind="workflow")
        assert runtime.executor.execute(run_id) == "Waiting"
        run = runtime.runs.get(run_id)
        assert run is not None
        runs.append(run)
    before = len(messages(runtime))

    # When one run is answered alone and two in one batch
    resumes = runtime.workflow_resumes
    resumes.respond(runs[0], {"ok": True}, resumable=True)
    outcomes = resumes.respond_many(
        [(runs[1], {"ok": True}), (runs[2], {"ok": True})], resumable=True
    )

    # Then each answered run wrote the same message, at its own RunCompleted's time
    assert all(isinstance(outcome, Run) for outcome in outcomes)
    written = messages(runtime)[before:]
    assert sorted((m.type, m.subject_id) for m in written) == sorted(
        ("run.completed", run.id) for run in runs
    )
    for message in written:
        assert message.tenant_id == acme
        assert message.created_at == event_at(runtime, str(message.subject_id), "RunCompleted")


def test_only_the_subscribed_types_are_written(make_runtime: MakeRuntime, sql_url: str) -> None:
    runtime = runtime_for(make_runtime, sql_url, CLOSE_THEN_ANSWER)
    endpoint(runtime, "acme", ["run.completed"])  # no approval events
    run_id = submit(runtime)

    assert runtime.executor.execute(run_id) == "Waiting"

    assert messages(runtime) == []


# -- tenants: only those with an enabled endpoint ------------------------------------------


def test_a_tenant_without_an_enabled_endpoint_gets_none_while_another_has_one(
    make_runtime: MakeRuntime, sql_url: str
) -> None:
    runtime = runtime_for(make_runtime, sql_url)
    globex = runtime.tenants.ensure_tenant("globex")
    endpoint(runtime, "globex", ["run.completed"])
    endpoint(runtime, "acme", ["run.completed"], enabled=False)
    endpoint(runtime, "initech", ["run.failed"])  # enabled, not for this type
    acme_run, initech_run, globex_run = (
        submit(runtime, "acme"),
        submit(runtime, "initech"),
        submit(runtime, "globex"),
    )

    for run_id in (acme_run, initech_run, globex_run):
        assert runtime.executor.execute(run_id) == "Completed"

    assert told(runtime) == [("run.completed", globex, globex_run)]


# -- the same transaction ---------------------------------------------------------------------


def test_a_final_write_that_lost_its_fence_writes_no_message(
    make_runtime: MakeRuntime, sql_url: str
) -> None:
    runtime = runtime_for(make_runtime, sql_url)
    endpoint(runtime, "acme", RUN_EVENTS)
    run_id = submit(runtime)
    old = claim_run(runtime, run_id, "worker-a")
    assert old is not None
    runtime.runs.release(old, "test")  # back to the queue: the next claim has a new fence
    new = claim_run(runtime, run_id, "worker-b")
    assert new is not None and new.fence == old.fence + 1

    assert runtime.runs.finish(old, RunStatus.COMPLETED, output={"text": "zombie"}) is None

    assert messages(runtime) == []
    assert runtime.runs.finish(new, RunStatus.COMPLETED, output={"text": "ok"}) is not None
    assert [m.type for m in messages(runtime)] == ["run.completed"]


def test_a_transaction_that_raises_after_the_event_leaves_no_message(
    make_runtime: MakeRuntime, sql_url: str
) -> None:
    runtime = runtime_for(make_runtime, sql_url)
    endpoint(runtime, "acme", RUN_EVENTS)
    run_id = submit(runtime)
    data = {"status": "Completed", "output": {"continuedIn": "r-2"}}

    with pytest.raises(RuntimeError, match="after the event"), runtime.db.write() as session:
        runtime.runs.append_in(session, None, "RunCompleted", data, run_id=run_id)
        assert session.scalar(sa.select(sa.func.count()).select_from(WebhookMessage)) == 1
        raise RuntimeError("after the event")

    assert messages(runtime) == []
    assert [e.type for e in runtime.runs.events(run_id)] == ["RunQueued"]


KILLED_WRITER = """
import os, sys, time
from tracon_jobs.runtime import Runtime
from tracon_jobs.settings import Settings
settings = Settings.model_validate(
    {"Database": {"Url": sys.argv[1]}, "Redis": {"Url": sys.argv[2]}}
)
runtime = Runtime(settings, sender=lambda run_id: None)
data = {"status": "Completed", "output": {"text": "never committed"}}
with runtime.db.write() as session:
    runtime.runs.append_in(session, None, "RunCompleted", data, run_id=sys.argv[3])
    session.flush()
    print("written", flush=True)
    time.sleep(60)
"""


def test_a_process_killed_before_its_commit_leaves_no_event_and_no_message(
    make_runtime: MakeRuntime, sql_url: str, redis_url: str
) -> None:
    # Given a process that wrote an event and its message, its transaction still open
    runtime = runtime_for(make_runtime, sql_url)
    endpoint(runtime, "acme", RUN_EVENTS)
    run_id = submit(runtime)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    child = subprocess.Popen(
        [sys.executable, "-c", KILLED_WRITER, sql_url, redis_url, run_id],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "written"

        # When it is killed before it commits
        child.send_signal(signal.SIGKILL)
        child.wait(10)
    finally:
        child.kill()

    # Then neither the event nor its message exists, and the run goes on as if untouched
    assert messages(runtime) == []
    assert [e.type for e in runtime.runs.events(run_id)] == ["RunQueued"]
    assert runtime.executor.execute(run_id) == "Completed"
    assert [m.type for m in messages(runtime)] == ["run.completed"]


# -- nobody listening costs nothing ---------------------------------------------------------


class RoundTrips:
    """What one thread's work costs, counted as bench/b5_round_trips.py counts it: SQL
    statements as the database receives them (SQLite's trace of every statement it runs;
    PostgreSQL's protocol trace: each simple query and each bound execution), and the commands
    the Redis server runs (`MONITOR`, a script's own commands and health checks left out).
    Only the test's thread counts: background pollers keep their own time."""

    def __init__(self, runtime: Runtime, redis_url: str) -> None:
        self.db = runtime.db
        self.thread = threading.get_ident()
        self.counting = False
        self.sql: Counter[str] = Counter()
        self.redis: Counter[str] = Counter()
        self._named: dict[tuple[int, str], str] = {}  # PostgreSQL's prepared statements
        self._traces: dict[int, Any] = {}
        self._monitor = redis.Redis.from_url(redis_url)
        sa.event.listen(self.db.engine, "checkout", self._checked_out)
        sa.event.listen(self.db.engine, "checkin", self._checked_in)
        self._watch_redis()

    def window(self) -> Iterator[None]:
        self.sql.clear()
        self.redis.clear()
        self.counting = True
        started = time.time()
        try:
            yield
        finally:
            self.counting = False
            self._redis_between(started, time.time())

    # SQL -------------------------------------------------------------------------------

    def _checked_out(self, dbapi: Any, _record: Any, _proxy: Any) -> None:
        if threading.get_ident() != self.thread:
            return
        if self.db.is_sqlite:
            dbapi.set_trace_callback(self._ran)
            return
        import psycopg

        trace = open(f"/tmp/pgtrace-{os.getpid()}-{id(dbapi)}", "w+")  # noqa: SIM115
        self._traces[id(dbapi)] = trace
        dbapi.pgconn.trace(trace.fileno())
        dbapi.pgconn.set_trace_flags(psycopg.pq.Trace.SUPPRESS_TIMESTAMPS)

    def _checked_in(self, dbapi: Any, _record: Any) -> None:
        if self.db.is_sqlite:
            dbapi.set_trace_callback(None)
            return
        trace = self._traces.pop(id(dbapi), None)
        if trace is None:
            return
        dbapi.pgconn.untrace()
        trace.seek(0)
        self._protocol(id(dbapi), trace.read())
        trace.close()
        os.unlink(trace.name)

    def _ran(self, statement: str) -> None:
        if self.counting:
            self.sql[statement.split(None, 1)[0].upper()] += 1

    def _protocol(self, connection: int, text: str) -> None:
        unnamed = "?"
        for line in text.splitlines():
            fields = line.split("\t")
            if len(fields) < 4 or fields[0] != "F":
                continue
            kind, rest = fields[2], fields[3].strip()
            if kind == "Query":
                self._ran(rest.strip('"'))
            elif kind == "Parse":
                name, sql = rest.split('" "', 1)
                first = sql.strip('"').split(None, 1)[0].upper()
                if name.strip('"'):
                    self._named[(connection, name.strip('"'))] = first
                else:
                    unnamed = first
            elif kind == "Bind" and self.counting:
                name = rest.split('" "', 1)[1].split('"', 1)[0]
                self.sql[self._named.get((connection, name), "?") if name else unnamed] += 1

    # Redis -----------------------------------------------------------------------------

    def _watch_redis(self) -> None:
        self._seen: list[tuple[float, str]] = []
        ready = threading.Event()

        def follow() -> None:
            try:
                with self._monitor.monitor() as monitor:
                    ready.set()
                    for entry in monitor.listen():
                        if entry.get("client_type") != "lua":
                            name = str(entry["command"]).split(" ", 1)[0].strip('"').upper()
                            self._seen.append((float(entry["time"]), name))
            except (redis.RedisError, OSError, ValueError):
                return

        threading.Thread(target=follow, daemon=True).start()
        assert ready.wait(5)

    def _redis_between(self, start: float, end: float) -> None:
        time.sleep(0.2)  # MONITOR's last lines
        for at, name in list(self._seen):
            if start <= at <= end and name not in ("PING", "MONITOR"):
                self.redis[name] += 1


def trivial_runs(runtime: Runtime, trips: RoundTrips, count: int) -> tuple[Counter[str], ...]:
    """SQL and Redis per `count` trivial runs (one model call, no tools), submitted and executed
    on this thread, after one run that warms up the process."""
    assert runtime.executor.execute(submit(runtime)) == "Completed"
    subscriptions = runtime.subscriptions
    assert isinstance(subscriptions, RedisSubscriptions)
    if runtime.runs.outbox is not None:  # its listener starts once a process, at first use
        assert subscriptions.subscribed.wait(5)
    # and the cancel listener, started by the first run, subscribes on its own thread
    assert runtime.cancel_bus.subscribed.wait(5)
    window = contextmanager(trips.window)
    with window():
        for _ in range(count):
            assert runtime.executor.execute(submit(runtime)) == "Completed"
    return Counter(trips.sql), Counter(trips.redis)


def test_nobody_listening_costs_no_statement_and_no_redis_command(
    make_runtime: MakeRuntime, sql_url: str, redis_url: str
) -> None:
    # Given the outbox wired as every process has it, and no endpoint anywhere
    runtime = runtime_for(make_runtime, sql_url)
    # (its listener subscribed before counting starts: the SUBSCRIBE is not a run's)
    assert isinstance(runtime.subscriptions, RedisSubscriptions)
    runtime.subscriptions.current()
    assert runtime.subscriptions.subscribed.wait(5)
    trips = RoundTrips(runtime, redis_url)
    outbox = runtime.runs.outbox

    # When trivial runs go with it, and without it
    wired = trivial_runs(runtime, trips, 5)
    runtime.runs.outbox = None
    bare = trivial_runs(runtime, trips, 5)

    # Then they cost the same, statement for statement and command for command
    assert wired == bare
    assert sum(bare[0].values()) >= 5 * 4 and sum(bare[1].values()) >= 5  # it counts
    # And the counting sees the outbox at work: with an endpoint of the runs' tenant, each
    # run writes its message (in the final write's own statement on PostgreSQL, one insert
    # more in its transaction on SQLite) and wakes the deliverers once
    runtime.runs.outbox = outbox
    endpoint(runtime, "acme", ["run.completed"])
    listened = trivial_runs(runtime, trips, 5)
    on_postgres = not runtime.db.is_sqlite
    assert listened[0] - bare[0] == (Counter() if on_postgres else Counter({"INSERT": 5}))
    assert listened[1] - bare[1] == Counter({"PUBLISH": 5})
    assert [m.type for m in messages(runtime)] == ["run.completed"] * 6


# -- the subscriptions every process keeps ----------------------------------------------------


def another_process(runtime: Runtime, redis_url: str, poll_seconds: float) -> RedisSubscriptions:
    """What another process keeps: its own cache, its own listener and poll."""
    watcher = RedisSubscriptions(
        runtime.db, redis.Redis.from_url(redis_url), poll_seconds=poll_seconds
    )
    assert not watcher.current().wants("run.completed")
    assert watcher.subscribed.wait(5)
    return watcher


def test_subscriptions_follow_the_changed_channel_at_once(
    make_runtime: MakeRuntime, sql_url: str, redis_url: str
) -> None:
    runtime = runtime_for(make_runtime, sql_url, Webhooks={"PollInterval": "00:01:00"})
    assert isinstance(runtime.subscriptions, RedisSubscriptions)
    assert runtime.subscriptions.poll_seconds == 60  # the setting
    watcher = another_process(runtime, redis_url, poll_seconds=60)
    try:
        # Given an endpoint written without a word: another process does not see it
        endpoint_id = endpoint(runtime, "acme", ["run.completed"])  # told
        took = wait_until(
            lambda: watcher.current().wants("run.completed"),
            what="the notice",
            timeout=20,
            interval=0.002,
        )
        assert took < 10  # not the poll's 60 s

        # When the endpoint is disabled without a notice, the cache stays as it was
        with runtime.db.write() as session:
            session.execute(
                sa.update(WebhookEndpoint)
                .where(WebhookEndpoint.id == endpoint_id)
                .values(enabled=False)
            )
        time.sleep(0.3)
        assert watcher.current().wants("run.completed")  # a minute's poll away

        # Then the notice alone makes it read again
        changed(runtime.redis)
        wait_until(
            lambda: not watcher.current().wants("run.completed"), what="the notice", timeout=0.5
        )
    finally:
        watcher.stop()


def test_subscriptions_follow_sql_on_the_poll_while_their_listener_is_down(
    make_runtime: MakeRuntime, sql_url: str
) -> None:
    runtime = runtime_for(make_runtime, sql_url)
    # a process whose listener cannot reach Redis
    watcher = RedisSubscriptions(
        runtime.db, redis.Redis.from_url("redis://127.0.0.1:1/0"), poll_seconds=0.3
    )
    assert not watcher.current().wants("run.completed")
    try:
        now = runtime.db.now()
        with runtime.db.write() as session:  # as a process that died before it told anyone
            session.add(
                WebhookEndpoint(
                    id=str(uuid.uuid4()),
                    tenant_id=runtime.tenants.ensure_tenant("acme"),
                    url="https://receiver.example/hook",
                    events=["approval.requested"],
                    secret="whsec_" + "B" * 32,
                    enabled=True,
                    created_at=now,
                    updated_at=now,
                )
            )
        took = wait_until(
            lambda: watcher.current().wants_of(
                runtime.tenants.ensure_tenant("acme"), "approval.requested"
            ),
            what="the poll",
            timeout=3,
        )
        assert took < 5  # the poll's (every 0.3 s): the listener hears nothing
        assert not watcher.current().wants_of("someone-else", "approval.requested")
    finally:
        watcher.stop()


def test_a_listening_process_does_not_poll_sql_every_interval(
    make_runtime: MakeRuntime, sql_url: str, redis_url: str
) -> None:
    runtime = runtime_for(make_runtime, sql_url)
    watcher = another_process(runtime, redis_url, poll_seconds=0.2)
    reads: list[float] = []
    refresh = watcher.refresh

    def counted() -> Wanted:
        reads.append(time.monotonic())
        return refresh()

    watcher.refresh = counted  # type: ignore[method-assign]  # counts the listener's reads
    try:
        watcher.current()
        wait_until(watcher.subscribed.is_set, what="the listener", timeout=3)
        settled = len(reads)
        time.sleep(1.0)  # five poll intervals
        assert len(reads) == settled, "a subscribed listener read SQL without a notice"
        changed(redis.Redis.from_url(redis_url))
        wait_until(lambda: len(reads) > settled, what="the notice", timeout=3)
    finally:
        watcher.stop()


def test_configuration_wants_events_of_every_tenant(
    make_runtime: MakeRuntime, sql_url: str
) -> None:
    runtime = runtime_for(
        make_runtime,
        sql_url,
        CLOSE_THEN_ANSWER,
        Webhooks={
            "Operator": {
                "Url": "https://ops.example/hook",
                "SecretEnv": "OPS_SECRET",
                "Events": ["run.failed", "circuit.opened"],
            }
        },
        Integrations={"Slack": {"BotTokenEnv": "SLACK_TOKEN", "SigningSecretEnv": "SLACK_SIGN"}},
    )
    wanted = runtime.subscriptions.current()
    assert wanted.everyone == {"run.failed", "circuit.opened", *APPROVAL_EVENTS}
    assert not wanted.gated("run.failed") and wanted.gated("run.completed")

    # A tenant without any endpoint: its approval goes to Slack, its runs' end nowhere
    run_id = submit(runtime)
    assert runtime.executor.execute(run_id) == "Waiting"
    [approval_id] = runtime.approval_store.pending_ids(run_id)
    acme = runtime.tenants.ensure_tenant("acme")
    assert told(runtime) == [("approval.requested", acme, approval_id)]


def test_one_process_keeps_its_subscriptions_in_memory(sql_url: str, redis_url: str) -> None:
    sections = {**scripted_agent(ANSWER), "Database": {"Url": sql_url}, "Redis": {"Url": redis_url}}
    subscriptions = MemorySubscriptions(Database(sql_url))
    runtime = Runtime(
        Settings.model_validate(sections), sender=lambda _run_id: None, subscriptions=subscriptions
    )
    try:
        assert runtime.executor.execute(submit(runtime)) == "Completed"
        endpoint(runtime, "acme", ["run.completed"])  # `changed`: read again, here
        run_id = submit(runtime)
        assert runtime.executor.execute(run_id) == "Completed"
        assert told(runtime) == [("run.completed", runtime.tenants.ensure_tenant("acme"), run_id)]
        assert runtime.subscriptions is subscriptions
    finally:
        runtime.close()
        subscriptions.db.dispose()


# -- quota.exceeded: once a quota window ------------------------------------------------------

FAILING_RUNS = """
import json, sys, time
from pathlib import Path
from tracon_jobs.runs.store import NewRun
from tracon_jobs.runtime import Runtime
from tracon_jobs.settings import Settings
settings = Settings.model_validate(json.loads(Path(sys.argv[1]).read_text()))
runtime = Runtime(settings, sender=lambda run_id: None)
tenant = runtime.tenants.ensure_tenant("acme")
ids = [runtime.runs.create(NewRun(tenant, "demo", {"message": "go"})).id for _ in range(4)]
runtime.subscriptions.current()
go = Path(sys.argv[2])
while not go.exists():
    time.sleep(0.005)
print(json.dumps([runtime.executor.execute(run_id) for run_id in ids]), flush=True)
runtime.close()
"""


def test_quota_exceeded_is_written_once_a_window_by_many_failing_runs(
    make_runtime: MakeRuntime, sql_url: str, redis_url: str, tmp_path: Path
) -> None:
    # Given a tenant whose quota is spent, subscribed to quota.exceeded, and two processes
    # ready to run four runs each
    sections = {
        **scripted_agent(ANSWER),
        "Database": {"Url": sql_url},
        "Redis": {"Url": redis_url},
    }
    runtime = make_runtime(sql_url, sender=lambda _run_id: None, **scripted_agent(ANSWER))
    acme = runtime.tenants.ensure_tenant("acme")
    runtime.quotas.set_quota(acme, "day", Decimal("0.08"))
    runtime.quotas.usage(acme)  # the counter, seeded
    runtime.quotas.spent(acme, Decimal("0.10"))
    endpoint(runtime, "acme", ["quota.exceeded", "run.failed"])
    config = tmp_path / "settings.json"
    config.write_text(json.dumps(sections))
    go = tmp_path / "go"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    children = [
        subprocess.Popen(
            [sys.executable, "-c", FAILING_RUNS, str(config), str(go)],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for _ in range(2)
    ]
    try:
        # When they all fail for the quota at the same time, and this process too
        wait_until(lambda: run_count(runtime) == 8, what="the runs", timeout=60)
        go.touch()
        here = [runtime.executor.execute(submit(runtime)) for _ in range(2)]
        outputs = [child.communicate(timeout=60)[0] for child in children]
    finally:
        for child in children:
            child.kill()

    # Then every run failed and told of it, and the quota was told of once
    assert [json.loads(out) for out in outputs] == [["Failed"] * 4] * 2 and here == ["Failed"] * 2
    kinds = Counter(m.type for m in messages(runtime))
    assert kinds == {"run.failed": 10, "quota.exceeded": 1}
    [quota] = [m for m in messages(runtime) if m.type == "quota.exceeded"]
    assert (quota.tenant_id, quota.subject_id) == (acme, acme)
    assert quota.dedupe_key is not None and quota.dedupe_key.startswith(f"quota.exceeded:{acme}:")
    assert (quota.data["used"], quota.data["limit"], quota.data["period"]) == (0.1, 0.08, "day")
    # And a submission refused 429 in the same window writes no second one
    client = create_app(runtime, {"TESTING": True}).test_client()
    key = runtime.tenants.issue_key(acme).secret
    refused = client.post("/api/agents/demo/run", json={"message": "go"}, headers=auth(key))
    assert refused.status_code == 429
    assert Counter(m.type for m in messages(runtime))["quota.exceeded"] == 1


def test_a_submission_refused_for_the_quota_writes_quota_exceeded_once(
    make_runtime: MakeRuntime, sql_url: str
) -> None:
    runtime = runtime_for(make_runtime, sql_url)
    acme = runtime.tenants.ensure_tenant("acme")
    runtime.quotas.set_quota(acme, "day", Decimal("0.08"))
    runtime.quotas.usage(acme)
    runtime.quotas.spent(acme, Decimal("0.09"))
    client = create_app(runtime, {"TESTING": True}).test_client()
    key = runtime.tenants.issue_key(acme).secret

    def submit_over_http() -> int:
        response = client.post("/api/agents/demo/run", json={"message": "go"}, headers=auth(key))
        return response.status_code

    # Given nobody subscribed: a refusal writes nothing
    assert submit_over_http() == 429
    assert messages(runtime) == []

    # When the tenant subscribes and is refused again, and again
    endpoint(runtime, "acme", ["quota.exceeded"])
    assert [submit_over_http() for _ in range(3)] == [429, 429, 429]

    # Then one message tells it, with the quota as GET /api/quota shows it
    [message] = messages(runtime)
    assert (message.type, message.tenant_id, message.subject_id) == ("quota.exceeded", acme, acme)
    assert message.data == client.get("/api/quota", headers=auth(key)).get_json()
    assert run_count(runtime) == 0


# -- circuit.opened and circuit.closed, moved from Redis ------------------------------------

OPERATOR = {"Url": "https://ops.example/hook", "SecretEnv": "OPS_SECRET"}
QUICK_BREAKER = {"FailureThreshold": 2, "BreakDuration": "00:00:02"}
"""A break long enough that the circuit is still open when a loaded machine reads it."""


def operator_runtime(make_runtime: MakeRuntime, sql_url: str, **webhooks: Any) -> Runtime:
    return runtime_for(
        make_runtime,
        sql_url,
        CircuitBreaker=QUICK_BREAKER,
        Webhooks={"Operator": OPERATOR, **webhooks},
    )


def circuit_messages(runtime: Runtime) -> list[WebhookMessage]:
    return [m for m in messages(runtime) if m.type.startswith("circuit.")]


def test_a_circuit_that_opens_and_closes_tells_the_operator_each_move_once(
    make_runtime: MakeRuntime, sql_url: str, redis_client: redis.Redis
) -> None:
    runtime = operator_runtime(make_runtime, sql_url, PollInterval="00:01:00")
    breaker = runtime.breaker
    client = create_app(runtime, {"TESTING": True}).test_client()
    key = runtime.tenants.issue_key(runtime.tenants.ensure_tenant("acme")).secret

    # When two failures open the circuit of `scripted`
    for _ in range(2):
        breaker.failure(breaker.admit("scripted"))
    wait_until(lambda: len(circuit_messages(runtime)) == 1, what="circuit.opened", timeout=5)

    # Then the operator's message tells it, as GET /api/circuits shows the circuit
    [opened] = circuit_messages(runtime)
    assert (opened.type, opened.tenant_id, opened.subject_id) == (
        "circuit.opened",
        None,
        "scripted",
    )
    [shown] = client.get("/api/circuits", headers=auth(key)).get_json()["items"]
    assert {**opened.data, "retryAfter": None} == {**shown, "retryAfter": None}
    assert opened.data["state"] == "open" and opened.data["consecutiveFailures"] == 2
    assert opened.data["retryAfter"] == pytest.approx(2.0, abs=0.01)
    assert opened.dedupe_key is not None and opened.dedupe_key.startswith("circuit:scripted:")
    assert redis_client.llen(TRANSITIONS_KEY) == 0

    # And a probe's success after the break closes it: one more message
    wait_until(
        lambda: runtime.breaker.snapshot("scripted").state == "half_open",
        what="the break",
        timeout=5,
    )
    probe = breaker.admit("scripted")
    assert probe.probe
    breaker.success(probe)
    wait_until(lambda: len(circuit_messages(runtime)) == 2, what="circuit.closed", timeout=5)
    closed = circuit_messages(runtime)[1]
    assert (closed.type, closed.data["state"], closed.data["retryAfter"]) == (
        "circuit.closed",
        "closed",
        None,
    )
    assert len(messages(runtime)) == 2  # nothing else: no tenant subscribed to anything


def test_circuit_moves_are_not_recorded_unless_the_operator_wants_them(
    make_runtime: MakeRuntime, sql_url: str, redis_client: redis.Redis
) -> None:
    runtime = runtime_for(make_runtime, sql_url, CircuitBreaker=QUICK_BREAKER)
    assert runtime.circuit_events is None
    for _ in range(2):
        runtime.breaker.failure(runtime.breaker.admit("scripted"))
    assert runtime.breaker.snapshot("scripted").state == "open"
    assert redis_client.llen(TRANSITIONS_KEY) == 0 and messages(runtime) == []


def test_a_move_whose_process_died_after_the_script_is_moved_by_another(
    make_runtime: MakeRuntime, sql_url: str, redis_url: str
) -> None:
    # Given a move recorded by the script of a process that died before it moved it
    store = RedisBreakerStore(redis.Redis.from_url(redis_url), transitions=TRANSITIONS_KEY)
    policy = BreakerPolicy(threshold=1, break_ms=5000, max_probes=1, probe_lease_ms=1000)
    assert store.admit("p-1", policy, "t").allowed
    assert store.record("p-1", policy, "t", "failure").after == "open"

    # When another process with a breaker polls
    runtime = operator_runtime(make_runtime, sql_url, PollInterval="00:00:00.200")
    assert runtime.circuit_events is not None and runtime.breaker is not None

    # Then the move becomes its message
    wait_until(lambda: len(circuit_messages(runtime)) == 1, what="the move", timeout=5)
    assert circuit_messages(runtime)[0].subject_id == "p-1"


def test_the_moves_of_a_provider_removed_from_the_configuration_are_moved_still(
    make_runtime: MakeRuntime, sql_url: str, redis_url: str
) -> None:
    # Given a move on the list of provider `gone`, which the configuration no longer names
    gone = transitions_key("gone")
    store = RedisBreakerStore(redis.Redis.from_url(redis_url), transitions=lambda _p: gone)
    policy = BreakerPolicy(threshold=1, break_ms=5000, max_probes=1, probe_lease_ms=1000)
    assert store.admit("gone", policy, "t").allowed
    assert store.record("gone", policy, "t", "failure").after == "open"

    # When a process with a breaker starts
    runtime = operator_runtime(make_runtime, sql_url, PollInterval="00:00:00.200")
    assert runtime.circuit_events is not None and gone not in runtime.circuit_events.keys[:-1]

    # Then it finds that list, and the move becomes its message
    wait_until(lambda: len(circuit_messages(runtime)) == 1, what="the move", timeout=5)
    assert circuit_messages(runtime)[0].subject_id == "gone"
    # (the mover takes a move off its list once its message is written)
    listed = redis.Redis.from_url(redis_url)
    wait_until(lambda: listed.llen(gone) == 0, what="the list emptied", timeout=5)
    assert len(circuit_messages(runtime)) == 1


MOVER = """
import json, sys, time
from pathlib import Path
from tracon_jobs.runtime import Runtime
from tracon_jobs.settings import Settings
from tracon_jobs.webhooks.circuits import TRANSITIONS_KEY, CircuitEvents
settings = Settings.model_validate(json.loads(Path(sys.argv[1]).read_text()))
runtime = Runtime(settings, sender=lambda run_id: None)
moves = CircuitEvents(
    runtime.redis, runtime.db, runtime.subscriptions, lambda provider: {"provider": provider},
    wake=runtime.outbox.wake, batch=5,
)
runtime.subscriptions.current()
runtime.redis.ping()
print("ready", flush=True)
go = Path(sys.argv[2])
while not go.exists():
    time.sleep(0.001)
taken = written = 0
while runtime.redis.llen(TRANSITIONS_KEY):
    batch = moves.move_batch()
    taken, written = taken + batch[0], written + batch[1]
print(json.dumps([taken, written]), flush=True)
runtime.close()
"""


def test_two_processes_moving_at_once_write_each_move_once(
    make_runtime: MakeRuntime, sql_url: str, redis_url: str, tmp_path: Path
) -> None:
    # Given 150 moves recorded (150 circuits opened) and two processes ready to move them
    store = RedisBreakerStore(redis.Redis.from_url(redis_url), transitions=TRANSITIONS_KEY)
    policy = BreakerPolicy(threshold=1, break_ms=60_000, max_probes=1, probe_lease_ms=1000)
    for i in range(150):
        store.record(f"p-{i}", policy, "t", "failure")
    runtime = make_runtime(sql_url, sender=lambda _run_id: None)  # no breaker: it moves nothing
    sections = {
        "Database": {"Url": sql_url},
        "Redis": {"Url": redis_url},
        "Webhooks": {"Operator": OPERATOR, "PollInterval": "00:00:00.050"},
    }
    config = tmp_path / "settings.json"
    config.write_text(json.dumps(sections))
    go = tmp_path / "go"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    children = [
        subprocess.Popen(
            [sys.executable, "-c", MOVER, str(config), str(go)],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for _ in range(2)
    ]
    try:
        assert [child.stdout.readline().strip() for child in children if child.stdout] == [
            "ready",
            "ready",
        ]
        go.touch()
        outputs = [child.communicate(timeout=60)[0] for child in children]
    finally:
        for child in children:
            child.kill()

    # Then every move is one message, whichever process wrote it
    found = circuit_messages(runtime)
    assert sorted(m.subject_id or "" for m in found) == sorted(f"p-{i}" for i in range(150))
    assert len({m.dedupe_key for m in found}) == 150
    assert redis.Redis.from_url(redis_url).llen(TRANSITIONS_KEY) == 0
    taken, written = zip(*(json.loads(out) for out in outputs), strict=True)
    assert min(taken) > 0 and sum(written) == 150, (taken, written)  # both moved, none twice


# -- bodies in the API's shapes ------------------------------------------------------------


def rendered(runtime: Runtime, message: WebhookMessage, **options: Any) -> dict[str, Any]:
    with runtime.db.read() as session:
        return render(session, message, **options)


def one(runtime: Runtime, type_: str) -> WebhookMessage:
    [message] = [m for m in messages(runtime) if m.type == type_]
    return message


@pytest.fixture
def api(make_runtime: MakeRuntime, sql_url: str) -> Iterator[tuple[Runtime, FlaskClient, str]]:
    runtime = runtime_for(make_runtime, sql_url, CLOSE_THEN_ANSWER)
    endpoint(runtime, "acme", [*RUN_EVENTS, *APPROVAL_EVENTS, "workflow.waiting"])
    key = runtime.tenants.issue_key(runtime.tenants.ensure_tenant("acme")).secret
    yield runtime, create_app(runtime, {"TESTING": True}).test_client(), key


def test_a_run_message_renders_the_run_as_the_api_returns_it(
    api: tuple[Runtime, FlaskClient, str],
) -> None:
    runtime, client, key = api
    run_id = submit(runtime)
    assert runtime.executor.execute(run_id) == "Waiting"
    [approval_id] = runtime.approval_store.pending_ids(run_id)
    client.post(f"/api/approvals/{approval_id}/decision", json={"approve": True}, headers=auth(key))
    assert runtime.executor.execute(run_id) == "Completed"

    message = one(runtime, "run.completed")
    body = rendered(runtime, message)

    assert body == {
        "type": "run.completed",
        "timestamp": message.created_at.isoformat(timespec="milliseconds") + "Z",
        "data": client.get(f"/api/runs/{run_id}", headers=auth(key)).get_json(),
    }
    assert body["data"]["output"] == {"text": "Done."}
    assert json.loads(json.dumps(body)) == body  # plain JSON, ready to be stored and sent


def test_an_approval_message_renders_the_approval_as_the_api_showed_it_after_the_event(
    api: tuple[Runtime, FlaskClient, str],
) -> None:
    # Given a request, as the API shows it then
    runtime, client, key = api
    run_id = submit(runtime)
    assert runtime.executor.execute(run_id) == "Waiting"
    [approval_id] = runtime.approval_store.pending_ids(run_id)
    path = f"/api/approvals/{approval_id}"
    requested = client.get(path, headers=auth(key)).get_json()
    waiting = client.get(f"/api/runs/{run_id}", headers=auth(key)).get_json()
    assert rendered(runtime, one(runtime, "approval.requested"))["data"] == requested
    assert waiting["pendingApprovals"] == [approval_id]

    # When it is decided, then consumed by the run that goes on
    decision = {"approve": True, "comment": "fine"}
    answered = client.post(f"{path}/decision", json=decision, headers=auth(key)).get_json()
    assert runtime.executor.execute(run_id) == "Completed"
    assert client.get(path, headers=auth(key)).get_json()["consumedAt"] is not None

    # Then each message still renders the approval as it was right after its event
    assert rendered(runtime, one(runtime, "approval.requested"))["data"] == requested
    decided = rendered(runtime, one(runtime, "approval.decided"))
    assert decided["data"] == answered and decided["data"]["status"] == "Approved"
    assert decided["type"] == "approval.decided"


def test_an_expired_approval_renders_expired_and_links_go_in_their_place(
    make_runtime: MakeRuntime, sql_url: str
) -> None:
    runtime = runtime_for(
        make_runtime, sql_url, CLOSE_THEN_ANSWER, Approvals={"Timeout": "00:00:00.200"}
    )
    endpoint(runtime, "acme", APPROVAL_EVENTS)
    run_id = submit(runtime)
    assert runtime.executor.execute(run_id) == "Waiting"
    time.sleep(0.3)
    assert len(runtime.approvals.expire_once(runtime.db.now())) == 1

    def links(approval: Any) -> dict[str, Any]:
        return {"approve": f"https://tracon.example/a/{approval.id}/approve"}

    body = rendered(runtime, one(runtime, "approval.expired"), links=links)
    [approval_id] = [m.subject_id for m in messages(runtime) if m.type == "approval.expired"]
    assert body["data"]["status"] == "Expired" and body["data"]["id"] == approval_id
    assert body["data"]["links"] == {"approve": f"https://tracon.example/a/{approval_id}/approve"}
    assert "links" not in rendered(runtime, one(runtime, "approval.requested"))["data"]


def test_a_workflow_waiting_message_renders_the_run_and_the_request(
    make_runtime: MakeRuntime, sql_url: str
) -> None:
    runtime = runtime_for(make_runtime, sql_url)  # its agent node answers at once
    endpoint(runtime, "acme", ["workflow.waiting"])
    key = runtime.tenants.issue_key(runtime.tenants.ensure_tenant("acme")).secret
    client = create_app(runtime, {"TESTING": True}).test_client()
    run_id = submit(runtime, agent="review", input={"orderId": "A-1"}, kind="workflow")
    assert runtime.executor.execute(run_id) == "Waiting"
    [asked] = [e.data for e in runtime.runs.events(run_id) if e.type == "WorkflowRequestCreated"]

    body = rendered(runtime, one(runtime, "workflow.waiting"))

    assert body["data"] == {
        "run": client.get(f"/api/runs/{run_id}", headers=auth(key)).get_json(),
        "request": asked,
    }
    assert body["data"]["request"] == {
        "node": "approve-reply#1",
        "payload": {"draft": "It shipped."},
    }


def test_data_held_elsewhere_renders_as_written(make_runtime: MakeRuntime, sql_url: str) -> None:
    runtime = runtime_for(make_runtime, sql_url)
    at = runtime.db.now()
    message = WebhookMessage(
        id="msg_01J00000000000000000000000",
        tenant_id=None,
        type="circuit.opened",
        subject_id="scripted",
        data={"provider": "scripted", "state": "open"},
        created_at=at,
    )
    assert rendered(runtime, message) == {
        "type": "circuit.opened",
        "timestamp": at.isoformat(timespec="milliseconds") + "Z",
        "data": {"provider": "scripted", "state": "open"},
    }


# -- the wake-up after the commit ---------------------------------------------------------


def test_a_commit_that_wrote_messages_wakes_the_deliverers_once(
    make_runtime: MakeRuntime, sql_url: str, redis_url: str
) -> None:
    two_closes: Script = [
        {
            "ToolCalls": [
                {"Name": "close_account", "Arguments": {"account": "acc-1"}},
                {"Name": "close_account", "Arguments": {"account": "acc-2"}},
            ]
        },
        {"Text": "Done."},
    ]
    runtime = runtime_for(make_runtime, sql_url, two_closes)
    endpoint(runtime, "acme", APPROVAL_EVENTS)
    pubsub = redis.Redis.from_url(redis_url).pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(WAKE_CHANNEL)
    assert pubsub.get_message(timeout=1) is None  # subscribed, nothing yet

    def wakes() -> list[bytes]:
        found = []
        while (message := pubsub.get_message(timeout=0.3)) is not None:
            found.append(message["data"])
        return found

    # A turn that asks two approvals: one transaction, two messages, one wake-up
    run_id = submit(runtime)
    assert runtime.executor.execute(run_id) == "Waiting"
    assert [m.type for m in messages(runtime)] == ["approval.requested"] * 2
    assert wakes() == [b"2"]
    # A run of a tenant nobody listens to: no message, no wake-up
    assert runtime.executor.execute(submit(runtime, "globex")) == "Waiting"
    assert wakes() == []
    pubsub.close()
