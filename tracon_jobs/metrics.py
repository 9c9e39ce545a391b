"""Prometheus metrics that stay true with several web and worker processes.

Two kinds, on purpose:

- **State** (how many runs are in each status, pending approvals, each circuit's state,
  slots in use, who owns each lease) is computed from SQL and Redis at scrape time by
  `StateCollector`, so every web process answers the same cluster-wide numbers whichever
  process changed them. Aggregate these with `max`, never `sum`, across instances.
- **Events** (run and model-call latencies, tokens and cost, tool-call outcomes, circuit
  transitions, slot waits, lease changes, idempotency outcomes) are counters and
  histograms recorded where they happen, in the process they happen in. A worker serves
  its own on `TRACON_WORKER_METRICS_PORT` (`start_worker_server`); the web's gunicorn
  workers share theirs through prometheus_client's multiprocess mode, which `tracon-jobs
  web` turns on (`prepare_multiprocess_dir`) before gunicorn forks. Sum these across
  instances.

A process that traces (`tracing`) gives each histogram observation an exemplar, the trace
and span it was made in; a worker's port serves them in the OpenMetrics format when the
scraper asks for it (prometheus_client keeps none in multiprocess mode: not the web's).

The recording functions below never raise: a metric must not fail a run.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from prometheus_client import (
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    values,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy import case, func, select

from tracon_jobs import tracing
from tracon_jobs.coordination import leases
from tracon_jobs.db import Database
from tracon_jobs.db.models import (
    IdempotencyRecord,
    Run,
    Tenant,
    WebhookDelivery,
    WebhookMessage,
)

log = logging.getLogger(__name__)

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
WORKER_PORT_ENV = "TRACON_WORKER_METRICS_PORT"

disable_created_metrics()  # `*_created` series double every counter's lines for no alert

LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600, 1800, 3600)
MODEL_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 15, 30, 60, 120)
WAIT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)

# -- events: recorded where they happen -----------------------------------------------------

RUN_SECONDS = Histogram(
    "tracon_run_duration_seconds",
    "Time a worker spent executing a run, from delivery to its final (or Waiting) write",
    ["status", "agent"],
    buckets=LATENCY_BUCKETS,
)
RUN_DELIVERIES = Counter(
    "tracon_run_deliveries",
    "Run messages a worker took, by what became of them "
    "(Completed, Failed, Canceled, Waiting, dropped, draining, taken_away, released)",
    ["outcome"],
)
RUN_MESSAGES = Counter(
    "tracon_run_messages_sent",
    "Run messages sent to the broker, by outcome (a message the fair lines keep counts when "
    "this process handed it to them)",
    ["outcome"],
)
MODEL_CALL_SECONDS = Histogram(
    "tracon_model_call_duration_seconds",
    "Provider call latency (slot wait excluded), by outcome: ok or the error kind",
    ["provider", "model", "outcome"],
    buckets=MODEL_BUCKETS,
)
MODEL_TOKENS = Counter(
    "tracon_model_tokens",
    "Tokens of answered model calls, by the model that answered and direction",
    ["provider", "model", "direction"],
)
MODEL_COST = Counter(
    "tracon_model_cost",
    "Cost of answered model calls in the pricing currency, by the model that answered",
    ["provider", "model", "currency"],
)
TOOL_CALLS = Counter(
    "tracon_tool_calls",
    "Tool executions (all attempts of one call), by outcome: succeeded, failed, timeout, canceled",
    ["tool", "outcome"],
)
TOOL_RETRIES = Counter("tracon_tool_retries", "Tool attempts started again", ["tool"])
CIRCUIT_TRANSITIONS = Counter(
    "tracon_circuit_transitions",
    "Circuit state changes this process caused, by provider",
    ["provider", "from", "to"],
)
SLOT_WAIT_SECONDS = Histogram(
    "tracon_slot_wait_seconds",
    "Time a model call waited for a provider concurrency slot (limited providers only)",
    ["provider"],
    buckets=WAIT_BUCKETS,
)
SLOT_WAITS = Counter(
    "tracon_slot_waits", "Model calls that found no free slot and had to wait", ["provider"]
)
RATE_LIMIT_WAIT_SECONDS = Histogram(
    "tracon_rate_limit_wait_seconds",
    "Time a model call waited for its provider's rate limits (limited providers only)",
    ["provider"],
    buckets=WAIT_BUCKETS,
)
RATE_LIMIT_WAITS = Counter(
    "tracon_rate_limit_waits",
    "Model calls that found their provider's rate limit spent and had to wait",
    ["provider"],
)
RUNS_PARKED = Counter(
    "tracon_runs_parked",
    "Runs this process parked (saved Queued to go on later), by reason",
    ["reason"],
)
LEASE_CHANGES = Counter(
    "tracon_lease_changes",
    "Singleton lease ownership changes in this process: acquired, lost, released",
    ["lease", "change"],
)
IDEMPOTENCY = Counter(
    "tracon_idempotency_requests",
    "Requests with an Idempotency-Key, by outcome "
    "(reserved: executed now, replay, in_progress, mismatch, invalid)",
    ["outcome"],
)
WEBHOOK_ATTEMPTS = Counter(
    "tracon_webhook_attempts",
    "Webhook delivery attempts, by target (endpoint, operator, slack) and what they made of "
    "the delivery: delivered, retried, failed (the schedule ran out), canceled (the target "
    "was gone), lost (a redelivery or a removal took the claim meanwhile)",
    ["target", "outcome"],
)
WEBHOOK_ATTEMPT_SECONDS = Histogram(
    "tracon_webhook_attempt_seconds",
    "Time a webhook attempt took, until its answer or its failure",
    ["target"],
    buckets=MODEL_BUCKETS,
)


def _safely(record: Callable[[], None]) -> None:
    try:
        record()
    except Exception:  # a metric must never fail the work it measures
        log.debug("metric not recorded", exc_info=True)


def run_finished(status: str, agent: str, seconds: float) -> None:
    """A delivery of a run ended; `status` is what `RunExecutor.execute` returned."""

    def record() -> None:
        RUN_DELIVERIES.labels(status).inc()
        if status in ("Completed", "Failed", "Canceled", "Waiting"):
            RUN_SECONDS.labels(status, agent).observe(seconds, tracing.exemplar())

    _safely(record)


def message_sent(ok: bool) -> None:
    _safely(lambda: RUN_MESSAGES.labels("sent" if ok else "refused").inc())


def model_call(provider: str, model: str, seconds: float, outcome: str = "ok") -> None:
    """One provider call ended: `ok`, or the `ProviderError.kind` it failed with."""
    _safely(
        lambda: MODEL_CALL_SECONDS.labels(provider, model, outcome).observe(
            seconds, tracing.exemplar()
        )
    )


@contextlib.contextmanager
def timed_model_call(provider: str, model: str) -> Iterator[None]:
    """`with timed_model_call(p, m): provider.complete(...)`: latency by outcome."""
    started = time.monotonic()
    outcome = "ok"
    try:
        yield
    except BaseException as exc:
        outcome = str(getattr(exc, "kind", None) or "error")
        raise
    finally:
        model_call(provider, model, time.monotonic() - started, outcome)


def model_spend(
    provider: str,
    model: str,
    input_tokens: int,
    output_tokens: int,
    cost: float,
    currency: str,
) -> None:
    """Tokens and cost of one answered call, at the model that actually answered."""

    def record() -> None:
        MODEL_TOKENS.labels(provider, model, "input").inc(max(input_tokens, 0))
        MODEL_TOKENS.labels(provider, model, "output").inc(max(output_tokens, 0))
        if cost > 0:
            MODEL_COST.labels(provider, model, currency).inc(cost)

    _safely(record)


def tool_call(tool: str, outcome: str) -> None:
    _safely(lambda: TOOL_CALLS.labels(tool, outcome).inc())


def tool_retry(tool: str) -> None:
    _safely(lambda: TOOL_RETRIES.labels(tool).inc())


def circuit_transition(provider: str, before: str, after: str) -> None:
    if before != after:
        _safely(lambda: CIRCUIT_TRANSITIONS.labels(provider, before, after).inc())


def slot_wait(provider: str, seconds: float, waited: bool) -> None:
    def record() -> None:
        SLOT_WAIT_SECONDS.labels(provider).observe(seconds, tracing.exemplar())
        if waited:
            SLOT_WAITS.labels(provider).inc()

    _safely(record)


def rate_limit_wait(provider: str, seconds: float, waited: bool) -> None:
    def record() -> None:
        RATE_LIMIT_WAIT_SECONDS.labels(provider).observe(seconds, tracing.exemplar())
        if waited:
            RATE_LIMIT_WAITS.labels(provider).inc()

    _safely(record)


def run_parked(reason: str) -> None:
    _safely(lambda: RUNS_PARKED.labels(reason).inc())


@cache
def _live_streams() -> tuple[Gauge, Counter]:
    """Created on first use: unlabelled, they would otherwise be made at import, before
    `prepare_multiprocess_dir` turns multiprocess mode on, and stay out of `/metrics`."""
    open_ = Gauge(
        "tracon_live_streams",
        "Live event streams open on this web node (each holds one of its tenant's places)",
        multiprocess_mode="livesum",
    )
    refused = Counter(
        "tracon_live_streams_refused",
        "Live event streams refused with 429: the tenant held Web.MaxStreamsPerTenant already",
    )
    return open_, refused


def live_stream(change: str, count: int = 1) -> None:
    """`count` streams `opened`, `closed` or `refused`."""

    def record() -> None:
        open_, refused = _live_streams()
        if change == "refused":
            refused.inc(count)
        elif change == "opened":
            open_.inc(count)
        else:
            open_.dec(count)

    _safely(record)


def webhook_attempt(target: str, outcome: str, seconds: float | None) -> None:
    """A delivery's attempt (`seconds` None: canceled without one)."""

    def record() -> None:
        WEBHOOK_ATTEMPTS.labels(target, outcome).inc()
        if seconds is not None:
            WEBHOOK_ATTEMPT_SECONDS.labels(target).observe(seconds, tracing.exemplar())

    _safely(record)


def lease_change(lease: str, change: str) -> None:
    _safely(lambda: LEASE_CHANGES.labels(lease, change).inc())


def idempotency_outcome(outcome: str) -> None:
    """`tracon_jobs.idempotency.Outcome` values, or `invalid` for a key refused with 400."""
    _safely(lambda: IDEMPOTENCY.labels(outcome).inc())


# -- state: computed at scrape time ---------------------------------------------------------

CIRCUIT_STATES = ("closed", "open", "half_open")


@dataclass(frozen=True)
class FairState:
    """Fair dispatch as Redis holds it (`coordination.fair_share`)."""

    lined: dict[str, int]  # tenant id -> runs waiting in its line
    on_their_way: int  # runs sent to the run queue, not yet claimed by a worker
    slots: int | None  # the live workers' registered slots; None: no worker registered
    running: int = 0  # runs claimed by a worker, holding their places until done
    reserve: int = 0  # the live workers' reserve threads (`Worker.FairReserve`)


class StateCollector(Collector):
    """Cluster-wide state read from SQL and Redis on every scrape; nothing kept in memory.

    Each source is optional and guarded: a store that does not answer drops its series and
    sets `tracon_state_up{source}` to 0 instead of failing the scrape.
    """

    def __init__(
        self,
        db: Database,
        *,
        circuits: Callable[[], Iterable[tuple[str, str, int]]] | None = None,
        slots: Callable[[], Iterable[tuple[str, int | None, int, int]]] | None = None,
        leases: Callable[[], Iterable[tuple[str, str | None]]] | None = None,
        draining: Callable[[], bool] | None = None,
        rates: Callable[[], Iterable[tuple[str, str, int, int, float]]] | None = None,
        fair: Callable[[], FairState] | None = None,
    ) -> None:
        self.fair = fair  # fair dispatch's lines, runs on their way, workers' slots
        self.rates = rates  # (scope, "requests" | "tokens", limit, used, seconds held)
        self.db = db
        self.circuits = circuits  # (provider, state, consecutive failures)
        self.slots = slots  # (provider, limit, in use, waiting)
        self.leases = leases  # (lease, owner or None)
        self.draining = draining  # this web node

    def collect(self) -> Iterator[Any]:
        up = GaugeMetricFamily(
            "tracon_state_up", "Whether a store answered this scrape (1) or not", labels=["source"]
        )
        try:
            yield from self._sql()
            up.add_metric(["sql"], 1.0)
        except Exception:
            log.warning("metrics: SQL did not answer", exc_info=True)
            up.add_metric(["sql"], 0.0)
        if self.circuits or self.slots or self.leases or self.rates or self.fair:
            try:
                yield from self._redis()
                up.add_metric(["redis"], 1.0)
            except Exception:
                log.warning("metrics: Redis did not answer", exc_info=True)
                up.add_metric(["redis"], 0.0)
        yield up
        if self.draining is not None:
            draining = GaugeMetricFamily(
                "tracon_web_draining", "Whether this web node drains (answers 503 to new runs)"
            )
            draining.add_metric([], 1.0 if self.draining() else 0.0)
            yield draining

    def _sql(self) -> Iterator[Any]:
        orphaned = case(((Run.status == "Failed") & (Run.error_type == "orphaned"), 1), else_=0)
        continued = case((Run.continued_from_run_id.is_not(None), 1), else_=0)
        query = (
            select(
                Run.status,
                Run.agent,
                Tenant.name,
                func.count(),
                func.coalesce(func.sum(orphaned), 0),
                func.coalesce(func.sum(continued), 0),
            )
            .join(Tenant, Tenant.id == Run.tenant_id)
            .group_by(Run.status, Run.agent, Tenant.name)
        )
        records = select(IdempotencyRecord.state, func.count()).group_by(IdempotencyRecord.state)
        pending = select(func.count(), func.min(WebhookDelivery.created_at)).where(
            WebhookDelivery.status == "pending"
        )
        waiting = select(func.count()).where(WebhookMessage.fanned_at.is_(None))
        with self.db.read() as session:
            rows = session.execute(query).all()
            record_rows = session.execute(records).all()
            pending_count, oldest = session.execute(pending).one()
            waiting_count = session.scalar(waiting) or 0
            now = self.db.now()

        runs = GaugeMetricFamily(
            "tracon_runs",
            "Runs by status, agent and tenant (all tenants, from SQL)",
            labels=["status", "agent", "tenant"],
        )
        orphans = CounterMetricFamily(
            "tracon_runs_orphaned",
            "Runs reconciliation closed as orphaned (from SQL)",
            labels=["agent", "tenant"],
        )
        continuations = CounterMetricFamily(
            "tracon_runs_continued",
            "Runs started to continue an orphaned run (from SQL)",
            labels=["agent", "tenant"],
        )
        per_agent: dict[tuple[str, str], list[int]] = {}
        for status, agent, tenant, count, orphan_count, continued_count in rows:
            runs.add_metric([status, agent, tenant], float(count))
            totals = per_agent.setdefault((agent, tenant), [0, 0])
            totals[0] += int(orphan_count)
            totals[1] += int(continued_count)
        for (agent, tenant), (orphan_count, continued_count) in sorted(per_agent.items()):
            orphans.add_metric([agent, tenant], float(orphan_count))
            continuations.add_metric([agent, tenant], float(continued_count))
        yield runs
        yield orphans
        yield continuations

        by_state = GaugeMetricFamily(
            "tracon_idempotency_records",
            "Idempotency records by state (InProgress ones a crash left need an operator)",
            labels=["state"],
        )
        found = {state: count for state, count in record_rows}
        for state in sorted({"InProgress", "Completed", *found}):
            by_state.add_metric([state], float(found.get(state, 0)))
        yield by_state

        yield GaugeMetricFamily(
            "tracon_webhook_deliveries_pending",
            "Webhook deliveries not delivered yet, due now or retried later (from SQL)",
            value=float(pending_count or 0),
        )
        yield GaugeMetricFamily(
            "tracon_webhook_oldest_pending_seconds",
            "Age of the oldest pending webhook delivery (0: none pending)",
            value=max((now - oldest).total_seconds(), 0.0) if oldest is not None else 0.0,
        )
        yield GaugeMetricFamily(
            "tracon_webhook_messages_waiting",
            "Webhook messages in the outbox not fanned out to their deliveries yet (from SQL)",
            value=float(waiting_count),
        )

    def _rates(self) -> Iterator[Any]:
        assert self.rates is not None
        limit = GaugeMetricFamily(
            "tracon_rate_limit",
            "A provider's (or model's) rate limit a minute, by kind (cluster-wide)",
            labels=["scope", "kind"],
        )
        used = GaugeMetricFamily(
            "tracon_rate_limit_used",
            "What the last 60 s of starts took of it (from Redis)",
            labels=["scope", "kind"],
        )
        held = GaugeMetricFamily(
            "tracon_rate_limit_held_seconds",
            "Seconds the provider's own word (Retry-After, rate-limit headers) still holds calls",
            labels=["scope"],
        )
        seen: set[str] = set()
        for scope, kind, most, taken, seconds in self.rates():
            limit.add_metric([scope, kind], float(most))
            used.add_metric([scope, kind], float(taken))
            if scope not in seen:
                seen.add(scope)
                held.add_metric([scope], seconds)
        yield limit
        yield used
        yield held

    def _tenant_names(self, ids: Iterable[str]) -> dict[str, str]:
        wanted = sorted(set(ids))
        if not wanted:
            return {}
        with self.db.read() as session:
            rows = session.execute(select(Tenant.id, Tenant.name).where(Tenant.id.in_(wanted)))
            return {tenant_id: name for tenant_id, name in rows}

    def _fair(self) -> Iterator[Any]:
        assert self.fair is not None
        state = self.fair()
        on_their_way = GaugeMetricFamily(
            "tracon_fair_on_their_way",
            "Runs fair dispatch sent to the run queue that no worker claimed yet "
            "(cluster-wide, from Redis)",
        )
        on_their_way.add_metric([], float(state.on_their_way))
        yield on_their_way
        running = GaugeMetricFamily(
            "tracon_fair_running",
            "Runs claimed by a worker that hold their fair-dispatch places until they end "
            "(cluster-wide, from Redis)",
        )
        running.add_metric([], float(state.running))
        yield running
        if state.slots is not None:
            slots = GaugeMetricFamily(
                "tracon_worker_slots",
                "Slots the live workers registered for fair dispatch, which lined runs share: "
                "their pools' sizes less the reserve threads (cluster-wide, from Redis)",
            )
            slots.add_metric([], float(state.slots))
            yield slots
            reserve = GaugeMetricFamily(
                "tracon_worker_fair_reserve",
                "Threads the live workers keep beyond their slots for runs of tenants without "
                "a fair-dispatch line (Worker.FairReserve; cluster-wide, from Redis)",
            )
            reserve.add_metric([], float(state.reserve))
            yield reserve
        try:
            names = self._tenant_names(state.lined)
        except Exception:  # SQL down: tracon_state_up{source="sql"} says so already
            log.warning("metrics: tenant names for the fair lines not read", exc_info=True)
            return
        lined = GaugeMetricFamily(
            "tracon_fair_lined",
            "Runs waiting (Queued) in each tenant's fair-dispatch line, not yet sent to the run "
            "queue; tenants with none lined are absent (from Redis)",
            labels=["tenant"],
        )
        for tenant_id, count in sorted(state.lined.items()):
            lined.add_metric([names.get(tenant_id, tenant_id)], float(count))
        yield lined

    def _redis(self) -> Iterator[Any]:
        if self.fair is not None:
            yield from self._fair()
        if self.rates is not None:
            yield from self._rates()
        if self.circuits is not None:
            state = GaugeMetricFamily(
                "tracon_circuit_state",
                "Each provider's circuit: 1 for its current state (cluster-wide, from Redis)",
                labels=["provider", "state"],
            )
            failures = GaugeMetricFamily(
                "tracon_circuit_consecutive_failures",
                "Counted failures since the circuit last closed",
                labels=["provider"],
            )
            for provider, current_state, count in self.circuits():
                for name in CIRCUIT_STATES:
                    state.add_metric([provider, name], 1.0 if name == current_state else 0.0)
                failures.add_metric([provider], float(count))
            yield state
            yield failures
        if self.slots is not None:
            limit = GaugeMetricFamily(
                "tracon_slots_limit", "Concurrency limit per provider", labels=["provider"]
            )
            in_use = GaugeMetricFamily(
                "tracon_slots_in_use", "Provider calls holding a slot", labels=["provider"]
            )
            waiting = GaugeMetricFamily(
                "tracon_slots_waiting", "Provider calls waiting for a slot", labels=["provider"]
            )
            for provider, max_calls, used, queued in self.slots():
                if max_calls is None:
                    continue
                limit.add_metric([provider], float(max_calls))
                in_use.add_metric([provider], float(used))
                waiting.add_metric([provider], float(queued))
            yield limit
            yield in_use
            yield waiting
        if self.leases is not None:
            owner = GaugeMetricFamily(
                "tracon_lease_owner",
                "1 for the process that holds each singleton lease (from Redis)",
                labels=["lease", "owner"],
            )
            held = GaugeMetricFamily(
                "tracon_lease_held", "Whether some process holds the lease", labels=["lease"]
            )
            for lease, holder in self.leases():
                held.add_metric([lease], 0.0 if holder is None else 1.0)
                if holder is not None:
                    owner.add_metric([lease, holder], 1.0)
            yield held
            yield owner


class WorkerCollector(Collector):
    """What only a worker process knows: whether it drains, which leases it believes it holds."""

    def __init__(
        self, draining: threading.Event | None, held: Callable[[], list[str]] | None = None
    ) -> None:
        self.draining = draining
        self.held = held

    def collect(self) -> Iterator[Any]:
        draining = GaugeMetricFamily(
            "tracon_worker_draining", "Whether this worker drains (claims no new run)"
        )
        draining.add_metric([], 1.0 if self.draining is not None and self.draining.is_set() else 0)
        yield draining
        if self.held is not None:
            held = GaugeMetricFamily(
                "tracon_worker_leases_held",
                "Singleton leases this worker believes it owns",
                labels=["lease"],
            )
            for lease in self.held():
                held.add_metric([lease], 1.0)
            yield held


# -- where the event metrics are served -----------------------------------------------------


def multiprocess_dir() -> str | None:
    return os.environ.get(MULTIPROC_ENV) or None


def prepare_multiprocess_dir(default: Path) -> Path:
    """Turn multiprocess mode on for this process and the ones it forks (gunicorn workers):
    `PROMETHEUS_MULTIPROC_DIR` (else `default`), emptied of an earlier run's files.

    Call it before gunicorn forks. Values created later (every metric here has labels, so
    each series is created on first use, or is itself created on first use) go to
    per-process files that `/metrics` merges.
    """
    path = Path(multiprocess_dir() or default)
    if path.exists():
        for entry in path.iterdir():
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
    path.mkdir(parents=True, exist_ok=True)
    os.environ[MULTIPROC_ENV] = str(path)
    values.ValueClass = values.get_value_class()  # in case prometheus_client was imported
    return path


def event_collector() -> Collector:
    """This process's event metrics: merged from every process's files in multiprocess mode
    (the web's gunicorn workers), else the default registry (a worker, a test)."""
    path = multiprocess_dir()
    if path is None:
        return REGISTRY
    from prometheus_client import multiprocess

    registry = CollectorRegistry(auto_describe=False)
    multiprocess.MultiProcessCollector(registry, path=path)
    return registry


def worker_port(environ: dict[str, str] | None = None) -> tuple[str, int] | None:
    """(address, port) from `TRACON_WORKER_METRICS_PORT` (`9808` or `127.0.0.1:9808`);
    None when unset or 0."""
    raw = (os.environ if environ is None else environ).get(WORKER_PORT_ENV, "").strip()
    if not raw:
        return None
    address, _, port = raw.rpartition(":")
    try:
        number = int(port)
    except ValueError:
        log.error("%s=%r is not a port; worker metrics are off", WORKER_PORT_ENV, raw)
        return None
    if number <= 0:
        return None
    return address or "0.0.0.0", number


def start_worker_server(
    draining: threading.Event | None = None,
    held: Callable[[], list[str]] | None = None,
    environ: dict[str, str] | None = None,
) -> int | None:
    """Serve this worker's metrics on `TRACON_WORKER_METRICS_PORT`; the port, or None
    when off or when it cannot listen (logged: metrics never stop a worker)."""
    where = worker_port(environ)
    if where is None:
        return None
    from prometheus_client import start_http_server

    registry = CollectorRegistry(auto_describe=False)
    registry.register(event_collector())
    registry.register(WorkerCollector(draining, held))
    address, port = where
    try:
        server, _thread = start_http_server(port, addr=address, registry=registry)
    except OSError as exc:
        log.error("worker metrics: cannot listen on %s:%d: %s", address, port, exc)
        return None
    bound = int(server.server_address[1])
    log.info("worker metrics on http://%s:%d/metrics", address, bound)
    return bound


leases.on_ownership_change(lease_change)
