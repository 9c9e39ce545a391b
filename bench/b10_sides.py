"""The two systems B10 (`bench.b10_dbos`) drives, behind one interface: their processes, how a
workflow is submitted and answered, and what their tables say of it.

- `TraconSide`: `tracon-jobs web` (2 gunicorn workers, 32 threads), one `tracon-jobs worker`
  (`Worker.Concurrency`), or for the recovery two workers and beat; workflows of
  `bench.b10_workflows` submitted over HTTP with `Prefer: respond-async`, answered on the
  respond route; a private Redis. Every count is one SQL query on `runs`.
- `DbosSide`: one `bench.b10_dbos_app` process; workflows enqueued and answered
  (`DBOS.send`) with a `DBOSClient`, which writes to the system database itself. Every count
  is one SQL query on `dbos.workflow_status` (or `dbos.operation_outputs`).

Both count steps in their own database's `b10_effects` (`bench.b10_effects`).
"""

from __future__ import annotations

import json
import sys
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import httpx
import redis
import sqlalchemy as sa

from bench import b10_workflows as flows
from bench.b1_throughput import api_client, child_env, choose_redis, issue_api_key
from bench.b10_effects import EFFECTS_ENV
from bench.harness import CLI, STARTUP_TIMEOUT, start_web
from tracon_jobs.cli.supervisor import Child, Supervisor, wait_until

if TYPE_CHECKING:
    from dbos import DBOSClient, EnqueueOptions

ASYNC = {"Prefer": "respond-async"}
ANSWER = {"text": "yes"}
WORKER_READY = "ready."
"""What a Celery worker logs once it consumes."""
DROPPED = "s: 'dropped'"
"""How a worker logs a delivery it dropped (`Task ...[id] succeeded in 0.01s: 'dropped'`)."""


@dataclass(frozen=True)
class Shape:
    """What both systems are given: the worker's concurrency, the client threads, the queue
    polling of DBOS, and tracon's reconciliation settings (None: its default)."""

    concurrency: int
    threads: int
    poll: float
    orphan_threshold: float | None
    scan_interval: float | None
    heartbeat_interval: float | None


class Side(Protocol):
    """One system under test; its processes are children of the shared `Supervisor`."""

    name: str
    engine: sa.Engine  # its scratch database: its own tables and b10_effects

    def start(self, recovery: bool) -> None:
        """Its processes for W1 and W3, or (`recovery`) for the recovery workload."""

    def submit(self, client: int, workflow: str, key: str, seconds: float | None) -> str:
        """Submit one workflow from client thread `client`; its id (run id, workflow id)."""

    def answer_many(self, client: int, idents: list[str]) -> None:
        """Answer the parked workflows `idents` from client thread `client`: one request
        where the system has one for many answers, else one each."""

    def open_count(self) -> int:
        """Workflows of any key not ended yet: one query over a status index."""

    def done(self, prefix: str) -> tuple[int, float | None]:
        """Workflows whose key starts with `prefix` that completed, and the last one's end
        (seconds since the epoch)."""

    def parked(self, prefix: str) -> int:
        """Workflows of `prefix` waiting for their answer."""

    def answered(self, prefix: str) -> dict[str, float]:
        """Parked workflow id -> when the workflow it continued in completed (epoch s)."""

    def holder(self) -> str:
        """The child whose threads a parked workflow would hold."""

    def kill(self) -> list[int]:
        """kill -9 of the process that loses its work, then whatever the system does next
        (DBOS: the same executor started again); the pids killed."""

    def resent(self, prefix: str) -> tuple[set[str], set[str]]:
        """Keys of `prefix` whose workflow was sent to a worker a second time (tracon: its
        run's message sent again, `enqueue_count` > 1; DBOS sends no messages: none), in two:
        those the killed process held at the kill (their message died with it: sending them
        again is the recovery), and the others (sent again by age: no record said why)."""

    def hit(self, prefix: str) -> tuple[int, float | None]:
        """Workflows of `prefix` the kill interrupted (in flight on the killed process, or
        held by it), and when the last of them completed (epoch s)."""

    def dropped(self) -> int:
        """Deliveries a worker dropped because their run was claimed already: a second
        message of a run whose first one a worker held and ran (DBOS sends none: 0)."""

    def facts(self, prefix: str) -> list[str]:
        """What its own tables say of the recovery workload (sent again, recovered, failed)."""

    def close(self) -> None: ...


# -- tracon ------------------------------------------------------------------------------------

TJ_OPEN = ("Queued", "Running", "Waiting")
TJ_DONE = sa.text(
    "SELECT count(*), extract(epoch FROM max(ended_at)) FROM runs WHERE status = 'Completed' "
    "AND input->>'key' LIKE :prefix AND output->>'continuedIn' IS NULL"
)
TJ_PARKED = sa.text(
    "SELECT count(*) FROM runs WHERE status = 'Waiting' AND input->>'key' LIKE :prefix"
)
TJ_ANSWERED = sa.text(
    "SELECT continued_from_run_id, extract(epoch FROM ended_at) FROM runs "
    "WHERE status = 'Completed' AND continued_from_run_id IS NOT NULL "
    "AND input->>'key' LIKE :prefix AND output->>'continuedIn' IS NULL"
)
TJ_RESENT = sa.text(
    "SELECT input->>'key', id FROM runs WHERE enqueue_count > 1 AND input->>'key' LIKE :prefix"
)
TJ_HIT = sa.text(
    "WITH hit AS (SELECT DISTINCT input->>'key' AS key FROM runs WHERE input->>'key' LIKE :prefix "
    "AND (error_type = 'interrupted' OR enqueue_count > 1)) "
    "SELECT count(DISTINCT hit.key), extract(epoch FROM max(runs.ended_at)) FROM hit "
    "LEFT JOIN runs ON runs.input->>'key' = hit.key AND runs.status = 'Completed' "
    "AND runs.output->>'continuedIn' IS NULL"
)
"""The runs the kill interrupted: closed `interrupted` by the orphan scan (in flight on the
killed worker), or sent again (reserved by it); their chains' completions."""
TJ_FACTS = sa.text(
    "SELECT count(*) FILTER (WHERE enqueue_count > 1), "
    "count(*) FILTER (WHERE status = 'Failed' AND error_type = 'interrupted'), "
    "count(*) FILTER (WHERE status = 'Failed' AND error_type IS DISTINCT FROM 'interrupted'), "
    "count(*) FILTER (WHERE continued_from_run_id IS NOT NULL) "
    "FROM runs WHERE input->>'key' LIKE :prefix"
)


class TraconSide:
    name = "tracon"

    def __init__(
        self,
        shape: Shape,
        database: str,
        workdir: Path,
        children: Supervisor,
        cleanup: ExitStack,
    ) -> None:
        self.shape = shape
        self.children = children
        self.engine = sa.create_engine(database)
        redis_url = choose_redis(None, workdir, cleanup)
        config = write_tracon_config(workdir, shape)
        self.env = child_env(
            TRACON_CONFIG=str(config),
            TRACON_DATABASE_URL=database,
            TRACON_REDIS_URL=redis_url,
            **{EFFECTS_ENV: database},
        )
        self.api_key = issue_api_key(self.env)
        self.clients: list[httpx.Client] = []
        self.redis_url = redis_url
        self.held_at_kill: set[str] = set()  # run ids the killed worker held (`kill`)

    def start(self, recovery: bool) -> None:
        self.close_clients()
        suffix = "-r" if recovery else ""
        base_url = start_web(self.children, self.env, workers=2, threads=32, name=f"web{suffix}")
        names = ["worker-a", "worker-b"] if recovery else ["worker"]
        workers = [
            self.children.start(name, [*CLI, "worker", "-n", f"b10-{name}@%h"], self.env)
            for name in names
        ]
        if recovery:
            self.children.start("beat", [*CLI, "beat"], self.env)
        for worker in workers:
            wait_for_log(self.children, worker, WORKER_READY)
        self.clients = [api_client(base_url, self.api_key) for _ in range(self.shape.threads)]

    def submit(self, client: int, workflow: str, key: str, seconds: float | None) -> str:
        body: dict[str, Any] = {"key": key} if seconds is None else {"key": key, "seconds": seconds}
        path = f"/api/workflows/{workflow}/run"
        response = self.clients[client].post(path, json={"input": body}, headers=ASYNC)
        if response.status_code != 202:
            raise RuntimeError(f"POST {path} -> {response.status_code}: {response.text}")
        return str(response.json()["runId"])

    def answer_many(self, client: int, idents: list[str]) -> None:
        if len(idents) == 1:  # the respond route
            path = f"/api/workflows/runs/{idents[0]}/respond"
            response = self.clients[client].post(path, json={"answer": ANSWER}, headers=ASYNC)
            if response.status_code != 202:
                raise RuntimeError(f"POST {path} -> {response.status_code}: {response.text}")
            return
        body = {"answers": [{"runId": ident, "answer": ANSWER} for ident in idents]}
        response = self.clients[client].post("/api/workflows/answers", json=body)
        if response.status_code != 200:
            raise RuntimeError(
                f"POST /api/workflows/answers -> {response.status_code}: {response.text}"
            )
        refused = [item for item in response.json()["items"] if item["status"] != 202]
        if refused:
            raise RuntimeError(f"POST /api/workflows/answers: not answered: {refused}")

    def open_count(self) -> int:
        query = sa.select(sa.func.count()).select_from(sa.table("runs", sa.column("status")))
        query = query.where(sa.column("status").in_(TJ_OPEN))
        return scalar(self.engine, query)

    def done(self, prefix: str) -> tuple[int, float | None]:
        return count_and_last(self.engine, TJ_DONE, prefix)

    def parked(self, prefix: str) -> int:
        return scalar(self.engine, TJ_PARKED, prefix=f"{prefix}%")

    def answered(self, prefix: str) -> dict[str, float]:
        with self.engine.connect() as conn:
            rows = conn.execute(TJ_ANSWERED, {"prefix": f"{prefix}%"}).all()
        return {str(waited): float(ended) for waited, ended in rows}

    def holder(self) -> str:
        return "worker"

    def kill(self) -> list[int]:
        victim = next(c for c in self.children.running() if c.name == "worker-a")
        victim.kill9()
        # What it held as it died (`coordination.held`): no write of it can come after this
        client = redis.Redis.from_url(self.redis_url, decode_responses=True)
        try:
            # a worker's records are named by its host, pid and a nonce (`Runtime.worker_id`)
            for key in client.scan_iter(match=f"tj:held:{{*:{victim.popen.pid}:*}}"):
                self.held_at_kill |= {str(member) for member in client.smembers(key)}
        finally:
            client.close()
        return [victim.popen.pid]

    def resent(self, prefix: str) -> tuple[set[str], set[str]]:
        with self.engine.connect() as conn:
            rows = conn.execute(TJ_RESENT, {"prefix": f"{prefix}%"}).all()
        lost = {str(key) for key, run_id in rows if str(run_id) in self.held_at_kill}
        return lost, {str(key) for key, _ in rows} - lost

    def dropped(self) -> int:
        workers = [c for c in self.children.children if c.name.startswith("worker")]
        return sum(c.text().count(DROPPED) for c in workers)

    def hit(self, prefix: str) -> tuple[int, float | None]:
        return count_and_last(self.engine, TJ_HIT, prefix)

    def facts(self, prefix: str) -> list[str]:
        with self.engine.connect() as conn:
            resent, interrupted, failed, continued = conn.execute(
                TJ_FACTS, {"prefix": f"{prefix}%"}
            ).one()
        return [
            f"{resent} runs sent again by the requeue scan (a message the killed worker had "
            "reserved; the guarded claim lets one delivery execute)",
            f"{interrupted} runs closed 'interrupted' by the orphan scan and resumed from their "
            f"checkpoints ({continued} continuation runs)",
            f"{failed} runs failed otherwise",
            f"{len(self.held_at_kill)} runs the killed worker's records held as it died",
        ]

    def close_clients(self) -> None:
        for client in self.clients:
            client.close()
        self.clients = []

    def close(self) -> None:
        self.close_clients()
        self.engine.dispose()


def write_tracon_config(workdir: Path, shape: Shape) -> Path:
    """Durable workflows as a user who wants them resumed after a crash configures them:
    checkpoints, `ResumeInterruptedRuns`, and the orphan scan that finds interrupted runs
    (at its defaults unless `shape` says otherwise)."""
    reconciliation: dict[str, Any] = {"Enabled": True}
    for setting, seconds in (
        ("OrphanThreshold", shape.orphan_threshold),
        ("ScanInterval", shape.scan_interval),
        ("HeartbeatInterval", shape.heartbeat_interval),
    ):
        if seconds is not None:
            reconciliation[setting] = duration(seconds)
    config = {
        "WorkflowModules": [flows.__name__],
        "Workflows": {"EnableCheckpointing": True, "ResumeInterruptedRuns": True},
        "RunReconciliation": reconciliation,
        "Worker": {"Concurrency": shape.concurrency},
    }
    path = workdir / "tracon.json"
    path.write_text(json.dumps({"Tracon": config}, indent=2))
    return path


def duration(seconds: float) -> str:
    """`HH:MM:SS.fff`, the settings' form of a duration."""
    whole, millis = divmod(round(seconds * 1000), 1000)
    minutes, secs = divmod(whole, 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours:02d}:{minutes:02d}:{secs:02d}.{millis:03d}"


# -- DBOS --------------------------------------------------------------------------------------

DBOS_OPEN = sa.text(
    "SELECT count(*) FROM dbos.workflow_status WHERE status IN ('ENQUEUED', 'PENDING')"
)
DBOS_DONE = sa.text(
    "SELECT count(*), max(completed_at) / 1000.0 FROM dbos.workflow_status "
    "WHERE status = 'SUCCESS' AND workflow_uuid LIKE :prefix"
)
DBOS_PARKED = sa.text(
    "SELECT count(DISTINCT workflow_uuid) FROM dbos.operation_outputs "
    "WHERE function_name = 'DBOS.sleep' AND workflow_uuid LIKE :prefix"
)
"""`DBOS.recv` records its timeout as a durable sleep before it waits: a parked workflow."""
DBOS_ANSWERED = sa.text(
    "SELECT workflow_uuid, completed_at / 1000.0 FROM dbos.workflow_status "
    "WHERE status = 'SUCCESS' AND workflow_uuid LIKE :prefix"
)
DBOS_FACTS = sa.text(
    "SELECT count(*) FILTER (WHERE recovery_attempts > 1), "
    "count(*) FILTER (WHERE status NOT IN ('SUCCESS', 'ENQUEUED', 'PENDING')) "
    "FROM dbos.workflow_status WHERE workflow_uuid LIKE :prefix"
)
DBOS_HIT = sa.text(
    "SELECT count(*), max(completed_at) / 1000.0 FROM dbos.workflow_status "
    "WHERE workflow_uuid LIKE :prefix AND recovery_attempts > 1"
)
"""The workflows the kill interrupted: started again by the recovery."""
EXECUTOR_ID = "b10-dbos"


class DbosSide:
    name = "DBOS"

    def __init__(self, shape: Shape, database: str, children: Supervisor) -> None:
        self.shape = shape
        self.database = database
        self.children = children
        self.engine = sa.create_engine(database)
        self.env = child_env(**{EFFECTS_ENV: database})
        self.client: DBOSClient | None = None
        self.process: Child | None = None
        self.starts = 0

    def start(self, recovery: bool) -> None:
        self.launch("dbos-r" if recovery else "dbos")
        if self.client is None:  # the system database exists once a DBOS process launched
            from dbos import DBOSClient

            pool = self.shape.threads + 2
            self.client = DBOSClient(
                system_database_url=self.database, system_database_pool_size=pool
            )

    def launch(self, name: str) -> None:
        argv = [
            sys.executable,
            "-m",
            "bench.b10_dbos_app",
            "--database",
            self.database,
            "--executor-id",
            EXECUTOR_ID,
            "--concurrency",
            str(self.shape.concurrency),
            "--poll",
            str(self.shape.poll),
        ]
        self.process = self.children.start(name, argv, self.env)
        wait_for_log(self.children, self.process, "b10 dbos ready")

    def submit(self, client: int, workflow: str, key: str, seconds: float | None) -> str:
        from bench.b10_dbos_app import PARKED_QUEUE, QUEUE

        assert self.client is not None
        queue = PARKED_QUEUE if workflow == flows.PARKED else QUEUE
        args: tuple[Any, ...] = (key,) if seconds is None else (key, seconds)
        options: EnqueueOptions = {
            "queue_name": queue,
            "workflow_name": workflow,
            "workflow_id": key,
        }
        self.client.enqueue(options, *args)
        return key

    def answer_many(self, client: int, idents: list[str]) -> None:
        from bench.b10_dbos_app import TOPIC

        assert self.client is not None
        for ident in idents:  # DBOS sends one message a call
            self.client.send(ident, ANSWER, topic=TOPIC)

    def open_count(self) -> int:
        return scalar(self.engine, DBOS_OPEN)

    def done(self, prefix: str) -> tuple[int, float | None]:
        return count_and_last(self.engine, DBOS_DONE, prefix)

    def parked(self, prefix: str) -> int:
        return scalar(self.engine, DBOS_PARKED, prefix=f"{prefix}%")

    def answered(self, prefix: str) -> dict[str, float]:
        with self.engine.connect() as conn:
            rows = conn.execute(DBOS_ANSWERED, {"prefix": f"{prefix}%"}).all()
        return {str(ident): float(ended) for ident, ended in rows}

    def holder(self) -> str:
        assert self.process is not None
        return self.process.name

    def kill(self) -> list[int]:
        """kill -9, then a process with the same executor id at once: its launch recovers
        the workflows the killed one left pending (DBOS's recovery of a local executor)."""
        assert self.process is not None
        victim = self.process
        victim.kill9()
        self.launch(f"{victim.name}2")
        return [victim.popen.pid]

    def resent(self, prefix: str) -> tuple[set[str], set[str]]:
        return set(), set()

    def dropped(self) -> int:
        return 0

    def hit(self, prefix: str) -> tuple[int, float | None]:
        return count_and_last(self.engine, DBOS_HIT, prefix)

    def facts(self, prefix: str) -> list[str]:
        with self.engine.connect() as conn:
            recovered, failed = conn.execute(DBOS_FACTS, {"prefix": f"{prefix}%"}).one()
        return [
            f"{recovered} workflows started again by the recovery (recovery_attempts > 1)",
            f"{failed} workflows ended otherwise than SUCCESS",
        ]

    def close(self) -> None:
        if self.client is not None:
            self.client.destroy()
            self.client = None
        self.engine.dispose()


# -- shared ------------------------------------------------------------------------------------


def count_and_last(
    engine: sa.Engine, query: sa.TextClause, prefix: str
) -> tuple[int, float | None]:
    """A count and a time (epoch s, None when nothing counted) of the keys of `prefix`."""
    with engine.connect() as conn:
        count, last = conn.execute(query, {"prefix": f"{prefix}%"}).one()
    return int(count), None if last is None else float(last)


def scalar(engine: sa.Engine, query: sa.Executable, **params: Any) -> int:
    with engine.connect() as conn:
        return int(conn.execute(query, params).scalar_one())


def wait_for_log(children: Supervisor, child: Child, text: str) -> None:
    wait_until(
        lambda: text in child.text(),
        what=f"{child.name} ({text!r} in its log)",
        timeout=STARTUP_TIMEOUT,
        watch=children.running(),
    )


def dbos_version() -> str | None:
    """The installed DBOS Transact's version; None when `dbos` is not importable."""
    try:
        from importlib.metadata import PackageNotFoundError, version

        import dbos  # noqa: F401
    except ImportError:
        return None
    try:
        return version("dbos")
    except PackageNotFoundError:
        return "unknown"
