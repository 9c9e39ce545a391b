"""`/metrics` and the worker's metrics endpoint: state from SQL and Redis at scrape time,
events recorded where they happen, the exact content type. Runs execute through the body
of the Celery task (`run_task`) on threads; tests/e2e covers real workers and gunicorn."""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from celery.utils.saferepr import saferepr
from flask import Flask
from flask.testing import FlaskClient
from prometheus_client import REGISTRY

from tests.helpers import MakeRuntime, ThreadWorker, scripted_agent
from tracon_jobs import metrics
from tracon_jobs.embedded_redis import free_port
from tracon_jobs.runs.dispatch import Sender
from tracon_jobs.runtime import Runtime
from tracon_jobs.worker.app import RunEndedCanceled, RunEndedFailed, describe_runs, run_task
from web import create_app

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def two_agents(**extra: Any) -> dict[str, Any]:
    """`demo` answers after one tool call; `broken` meets a provider that answers 503."""
    sections = scripted_agent(
        [
            {"ToolCalls": [{"Name": "lookup_order", "Arguments": {"order_id": "A-1"}}]},
            {"Text": "It shipped.", "InputTokens": 7, "OutputTokens": 3},
        ],
        ["lookup_order"],
    )
    sections["Providers"]["down"] = {"Kind": "scripted", "Script": [{"ErrorStatus": 503}]}
    sections["Agents"]["broken"] = {
        "Instructions": "fails",
        "Model": {"provider": "down", "model": "demo-model"},
    }
    sections.update(extra)
    return sections


def task_sender(worker: ThreadWorker, runtime: Runtime, ended: list[str]) -> Sender:
    """Runs each message through the Celery task's body, on a thread, as a worker would."""
    describe = describe_runs(runtime.db)

    def body(run_id: str) -> None:
        try:
            ended.append(run_task(runtime.executor.execute, describe, run_id))
        except (RunEndedFailed, RunEndedCanceled) as exc:
            ended.append(f"{type(exc).__name__}: {exc}")

    def send(run_id: str) -> None:
        worker.start(body, run_id)

    return send


@pytest.fixture
def ended() -> list[str]:
    return []


@pytest.fixture
def runtime(
    make_runtime: MakeRuntime, sql_url: str, thread_worker: ThreadWorker, ended: list[str]
) -> Runtime:
    rt = make_runtime(
        sql_url,
        **two_agents(
            CircuitBreaker={"FailureThreshold": 1, "BreakDuration": "00:01:00"},
            ModelConcurrency={"MaxConcurrentCallsPerProvider": 4},
        ),
    )
    rt.send_runs_with(task_sender(thread_worker, rt, ended))
    return rt


@pytest.fixture
def app(runtime: Runtime) -> Flask:
    return create_app(runtime, {"TESTING": True})


def run(client: FlaskClient, key: str, agent: str) -> dict[str, Any]:
    response = client.post(
        f"/api/agents/{agent}/run",
        headers={"Authorization": f"Bearer {key}", "Prefer": "respond-async"},
        json={"message": "Where is A-1?"},
    )
    body = response.get_json()
    assert isinstance(body, dict), response.get_data(as_text=True)
    return body


def wait_ended(ended: list[str], count: int) -> None:
    done = threading.Event()
    for _ in range(200):
        if len(ended) >= count:
            done.set()
            break
        done.wait(0.05)
    assert done.is_set(), f"only {len(ended)} of {count} task bodies ended: {ended}"


SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][\w:]*)(?:\{(?P<labels>.*)\})? (?P<value>\S+)$")


def samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """Every sample of `name` in a text exposition, with its labels."""
    found = []
    for line in text.splitlines():
        match = SAMPLE.match(line)
        if match is None or match["name"] != name:
            continue
        labels = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', match["labels"] or ""))
        found.append((labels, float(match["value"])))
    return found


def value(text: str, name: str, **labels: str) -> float | None:
    hits = [v for found, v in samples(text, name) if found == labels]
    assert len(hits) <= 1, hits
    return hits[0] if hits else None


def sample(name: str, **labels: str) -> float:
    """A sample of this process's default registry (event metrics), 0 when absent."""
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_metrics_show_runs_by_status_agent_and_tenant_from_sql(
    client: FlaskClient, key: str, ended: list[str]
) -> None:
    # Given one run that completes and one whose provider fails
    run(client, key, "demo")
    run(client, key, "broken")
    wait_ended(ended, 2)

    # When /metrics is scraped
    response = client.get("/metrics")

    # Then its content type is exactly Prometheus' text format 0.0.4
    assert response.headers["Content-Type"] == CONTENT_TYPE
    text = response.get_data(as_text=True)
    # and the runs are counted from SQL by status, agent and tenant
    assert value(text, "tracon_runs", status="Completed", agent="demo", tenant="acme") == 1
    assert value(text, "tracon_runs", status="Failed", agent="broken", tenant="acme") == 1
    assert value(text, "tracon_runs", status="Failed", agent="demo", tenant="acme") is None
    assert value(text, "tracon_runs_orphaned_total", agent="broken", tenant="acme") == 0
    assert value(text, "tracon_state_up", source="sql") == 1
    assert value(text, "tracon_state_up", source="redis") == 1
    assert value(text, "tracon_web_draining") == 0
    # and approvals are still there
    assert value(text, "tracon_approvals_pending") == 0


def test_metrics_show_each_tenants_fair_line_runs_on_their_way_and_workers_slots(
    client: FlaskClient, runtime: Runtime, key: str
) -> None:
    acme = runtime.tenants.ensure_tenant("acme")
    globex = runtime.tenants.ensure_tenant("globex")
    store = runtime.fair_store
    # Given no worker registered: no slots are shown, nothing is lined or on its way
    text = client.get("/metrics").get_data(as_text=True)
    assert value(text, "tracon_worker_slots") is None
    assert value(text, "tracon_fair_on_their_way") == 0
    assert samples(text, "tracon_fair_lined") == []
    # When a worker registers 2 slots and 1 reserve thread, acme offers 5 runs and globex 1
    store.register("w1", 2, {}, reserve=1)
    for i in range(5):
        store.offer(f"a{i}", acme, 5, None)
    store.offer("g0", globex, 5, None)  # its turn, with no line: the reserve
    store.offer("g1", globex, 5, None)
    store.take("a0")
    text = client.get("/metrics").get_data(as_text=True)
    # Then the lines are counted per tenant by name, with the runs on their way, the runs
    # running, the slots and the reserve
    assert value(text, "tracon_fair_lined", tenant="acme") == 3
    assert value(text, "tracon_fair_lined", tenant="globex") == 1
    assert value(text, "tracon_fair_on_their_way") == 2
    assert value(text, "tracon_fair_running") == 1
    assert value(text, "tracon_worker_slots") == 2
    assert value(text, "tracon_worker_fair_reserve") == 1
    assert "# TYPE tracon_fair_lined gauge\n" in text
    # and the ends that let globex's run go (its pass ties with acme's) leave globex out of
    # the lines
    assert sorted(store.done("a0") + store.done("a1")) == ["a2", "g1"]
    text = client.get("/metrics").get_data(as_text=True)
    assert value(text, "tracon_fair_lined", tenant="globex") is None
    assert value(text, "tracon_fair_lined", tenant="acme") == 2
    assert value(text, "tracon_fair_running") == 0
    # and once the worker leaves, no slots are shown
    store.leave("w1")
    text = client.get("/metrics").get_data(as_text=True)
    assert value(text, "tracon_worker_slots") is None


def test_a_redis_that_does_not_answer_drops_the_fair_series_not_the_scrape(
    make_runtime: MakeRuntime, sql_url: str
) -> None:
    down = f"redis://127.0.0.1:{free_port()}/0"
    rt = make_runtime(sql_url, Redis={"Url": down}, **two_agents())
    app = create_app(rt, {"TESTING": True})

    response = app.test_client().get("/metrics")

    assert response.status_code == 200
    text = response.get_data(as_text=True)
    assert value(text, "tracon_state_up", source="redis") == 0
    assert value(text, "tracon_state_up", source="sql") == 1
    assert value(text, "tracon_fair_on_their_way") is None
    assert samples(text, "tracon_fair_lined") == []


def test_metrics_name_every_histogram_and_counter_operators_alert_on(
    client: FlaskClient,
) -> None:
    text = client.get("/metrics").get_data(as_text=True)

    for name, kind in [
        ("tracon_run_duration_seconds", "histogram"),
        ("tracon_model_call_duration_seconds", "histogram"),
        ("tracon_slot_wait_seconds", "histogram"),
        ("tracon_model_tokens", "counter"),
        ("tracon_model_cost", "counter"),
        ("tracon_tool_calls", "counter"),
        ("tracon_tool_retries", "counter"),
        ("tracon_circuit_transitions", "counter"),
        ("tracon_slot_waits", "counter"),
        ("tracon_lease_changes", "counter"),
        ("tracon_idempotency_requests", "counter"),
        ("tracon_run_deliveries", "counter"),
        ("tracon_runs_orphaned", "counter"),
        ("tracon_runs_continued", "counter"),
        ("tracon_approval_decisions", "counter"),
        ("tracon_runs", "gauge"),
        ("tracon_circuit_state", "gauge"),
        ("tracon_slots_in_use", "gauge"),
        ("tracon_lease_held", "gauge"),
        ("tracon_idempotency_records", "gauge"),
        ("tracon_web_draining", "gauge"),
        ("tracon_fair_on_their_way", "gauge"),
    ]:
        exposed = f"{name}_total" if kind == "counter" else name
        assert f"# TYPE {exposed} {kind}\n" in text, name
    assert "_created" not in text  # creation-time series are switched off


def test_task_body_records_latency_tokens_tool_outcomes_and_the_circuit(
    client: FlaskClient, key: str, ended: list[str]
) -> None:
    before: dict[str, Callable[[], float]] = {
        "completed": lambda: sample(
            "tracon_run_duration_seconds_count", status="Completed", agent="demo"
        ),
        "failed": lambda: sample(
            "tracon_run_duration_seconds_count", status="Failed", agent="broken"
        ),
        "tool": lambda: sample("tracon_tool_calls_total", tool="lookup_order", outcome="succeeded"),
        "opened": lambda: sample(
            "tracon_circuit_transitions_total", provider="down", **{"from": "closed", "to": "open"}
        ),
        "slot": lambda: sample("tracon_slot_wait_seconds_count", provider="scripted"),
    }
    start = {name: read() for name, read in before.items()}

    run(client, key, "demo")
    run(client, key, "broken")
    wait_ended(ended, 2)

    delta = {name: read() - start[name] for name, read in before.items()}
    assert delta == {"completed": 1, "failed": 1, "tool": 1, "opened": 1, "slot": 2}
    # the failed run's task raised with the run's error (what Flower shows)
    assert any(e.startswith("RunEndedFailed: ") and "down" in e for e in ended), ended

    text = client.get("/metrics").get_data(as_text=True)
    assert value(text, "tracon_circuit_state", provider="down", state="open") == 1
    assert value(text, "tracon_circuit_state", provider="down", state="closed") == 0
    assert value(text, "tracon_circuit_state", provider="scripted", state="closed") == 1
    assert value(text, "tracon_circuit_consecutive_failures", provider="down") == 1
    assert value(text, "tracon_slots_limit", provider="scripted") == 4
    assert value(text, "tracon_slots_in_use", provider="scripted") == 0


def test_run_ids_agent_and_tenant_travel_as_task_kwargs(
    runtime: Runtime, key: str, client: FlaskClient
) -> None:
    """`celery_sender` names the run's agent and tenant (read by `describe`), so Flower's
    task list shows them; a broker that refuses counts as refused."""
    from tracon_jobs.worker.envelope import celery_sender

    sent: list[dict[str, Any]] = []

    class Broker:
        def send_task(self, name: str, **options: Any) -> None:
            sent.append({"name": name, **options})

    labels = describe_runs(runtime.db)
    send = celery_sender(Broker(), lambda run_id: _labels(labels, run_id))
    tenant = runtime.tenants.ensure_tenant("acme")
    from tracon_jobs.runs.store import NewRun

    run_row = runtime.runs.create(NewRun(tenant, "demo", {"message": "x"}))
    send(run_row.id)
    send("no-such-run")

    assert [m["kwargs"] for m in sent] == [
        {"run_id": run_row.id, "agent": "demo", "tenant": "acme"},
        {"run_id": "no-such-run"},
    ]
    assert all(m["name"] == "tracon.runs.execute" and "args" not in m for m in sent)
    # what Flower shows for the arguments: as Celery's own saferepr gives them
    assert [(m["argsrepr"], m["kwargsrepr"]) for m in sent] == [
        (saferepr(()), saferepr(m["kwargs"])) for m in sent
    ]


def _labels(describe: Callable[[str], Any], run_id: str) -> tuple[str, str] | None:
    summary = describe(run_id)
    return None if summary is None else (summary.agent, summary.tenant)


def test_worker_metrics_endpoint_serves_events_and_drain_state() -> None:
    draining = threading.Event()
    port = free_port()

    bound = metrics.start_worker_server(
        draining, lambda: ["tracon.reconcile.scan"], {metrics.WORKER_PORT_ENV: f"127.0.0.1:{port}"}
    )

    assert bound == port
    metrics.tool_call("probe_tool", "failed")
    response = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5)
    assert response.status_code == 200
    assert response.headers["Content-Type"] == CONTENT_TYPE
    assert value(response.text, "tracon_worker_draining") == 0
    assert value(response.text, "tracon_worker_leases_held", lease="tracon.reconcile.scan") == 1
    assert value(response.text, "tracon_tool_calls_total", tool="probe_tool", outcome="failed")
    draining.set()
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    assert value(text, "tracon_worker_draining") == 1


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("", None),
        ("0", None),
        ("nope", None),
        ("9808", ("0.0.0.0", 9808)),
        ("127.0.0.1:9100", ("127.0.0.1", 9100)),
    ],
)
def test_worker_metrics_port_setting(raw: str, expected: tuple[str, int] | None) -> None:
    assert metrics.worker_port({metrics.WORKER_PORT_ENV: raw}) == expected
