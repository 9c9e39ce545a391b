"""`Idempotency-Key` through the real Flask app, real SQL and real Redis: every row of the
spec's "Exact outcomes" table, the buffered run response, tenants, and the no-header path.

Runs are executed by the real executor on a thread standing in for a worker.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import sqlalchemy as sa
from flask.testing import FlaskClient

from tests.helpers import MakeRuntime, ThreadWorker, hold_queued, scripted_agent, wait_until
from tracon_jobs.db.models import IdempotencyRecord, Run
from tracon_jobs.errors import EnqueueError
from tracon_jobs.idempotency import IdempotencyStore
from tracon_jobs.runtime import Runtime
from web import create_app

PATH = "/api/agents/demo/run"
BODY = b'{"message": "Where is A-1?"}'


def make(make_runtime: MakeRuntime, sql_url: str, worker: ThreadWorker, **sections: Any) -> Runtime:
    """A runtime whose runs `worker` executes on threads."""
    config = scripted_agent([{"Text": "It shipped.", "InputTokens": 7, "OutputTokens": 3}])
    rt = make_runtime(sql_url, **{**config, **sections})
    rt.send_runs_with(worker.sender(rt))
    return rt


@pytest.fixture
def runtime(make_runtime: MakeRuntime, sql_url: str, thread_worker: ThreadWorker) -> Runtime:
    return make(make_runtime, sql_url, thread_worker)


@pytest.fixture
def client(runtime: Runtime) -> FlaskClient:
    return create_app(runtime, {"TESTING": True, "SSE_KEEPALIVE_SECONDS": 0.5}).test_client()


def headers(api_key: str, idem: str | None = "k-1", **extra: str) -> dict[str, str]:
    out = {"Authorization": f"Bearer {api_key}", "Content-Type": "application/json", **extra}
    if idem is not None:
        out["Idempotency-Key"] = idem
    return out


def post(client: FlaskClient, api_key: str, body: bytes = BODY, **kw: Any) -> Any:
    path = kw.pop("path", PATH)
    return client.post(path, data=body, headers=headers(api_key, **kw))


def runs_of(runtime: Runtime) -> list[Run]:
    with runtime.db.read() as session:
        return list(session.scalars(sa.select(Run)))


def records(runtime: Runtime) -> list[IdempotencyRecord]:
    with runtime.db.read() as session:
        return list(session.scalars(sa.select(IdempotencyRecord)))


# -- first request, replay --------------------------------------------------------------


def test_first_request_executes_and_answers_one_buffered_run_json(
    client: FlaskClient, key: str, runtime: Runtime
) -> None:
    response = post(client, key)

    assert response.status_code == 200
    assert response.mimetype == "application/json"
    run = response.get_json()
    assert run["status"] == "Completed" and run["output"] == {"text": "It shipped."}
    assert run["usage"]["totalTokens"] == 10
    [record] = records(runtime)
    assert record.state == "Completed" and record.run_id == run["id"]
    assert record.response_status == 200 and bytes(record.response_body or b"") == response.data


def test_same_request_replays_status_body_and_content_type_without_executing(
    client: FlaskClient, key: str, runtime: Runtime
) -> None:
    first = post(client, key)

    again = post(client, key)

    assert again.status_code == first.status_code == 200
    assert again.data == first.data
    assert again.content_type == first.content_type
    assert again.headers["Idempotency-Replayed"] == "true"
    assert "Idempotency-Replayed" not in first.headers
    assert len(runs_of(runtime)) == 1


def test_respond_async_with_a_key_stores_and_replays_the_202(
    client: FlaskClient, key: str, runtime: Runtime
) -> None:
    first = post(client, key, Prefer="respond-async")

    again = post(client, key, Prefer="respond-async")

    assert first.status_code == again.status_code == 202
    run_id = first.get_json()["runId"]
    for response in (first, again):
        assert response.headers["Location"] == f"/api/runs/{run_id}"
        assert response.headers["Preference-Applied"] == "respond-async"
    assert again.data == first.data and again.headers["Idempotency-Replayed"] == "true"
    assert [run.id for run in runs_of(runtime)] == [run_id]
    assert records(runtime)[0].run_id == run_id


# -- in progress, mismatch --------------------------------------------------------------


def test_same_key_still_in_progress_is_409(
    make_runtime: MakeRuntime, sql_url: str, thread_worker: ThreadWorker
) -> None:
    # Given a request whose run takes a second
    rt = make(make_runtime, sql_url, thread_worker, Providers=slow_provider(1.0))
    client = create_app(rt, {"TESTING": True}).test_client()
    key = rt.tenants.issue_key(rt.tenants.ensure_tenant("acme")).secret
    first: list[Any] = []
    thread = threading.Thread(target=lambda: first.append(post(client, key)))
    thread.start()
    wait_until(
        lambda: any(r.run_id for r in records(rt)), what="the first request's run", timeout=10
    )

    # When the same request arrives meanwhile
    duplicate = post(client, key)

    # Then it is refused with 409, and the first one completes normally
    assert duplicate.status_code == 409
    assert duplicate.mimetype == "application/problem+json"
    assert duplicate.get_json()["code"] == "idempotency_key_in_progress"
    thread.join(10)
    assert first[0].status_code == 200
    assert len(runs_of(rt)) == 1


def slow_provider(delay: float) -> dict[str, Any]:
    return {"scripted": {"Kind": "scripted", "Script": [{"Text": "slow", "DelaySeconds": delay}]}}


def test_same_key_with_a_different_body_is_422(client: FlaskClient, key: str) -> None:
    post(client, key)

    # whitespace alone makes it a different request: the fingerprint is the raw bytes
    response = post(client, key, body=b'{"message":"Where is A-1?"}')

    assert response.status_code == 422
    assert response.get_json()["code"] == "idempotency_key_reused"


def test_same_key_with_a_different_path_is_422(
    make_runtime: MakeRuntime, sql_url: str, thread_worker: ThreadWorker
) -> None:
    config = scripted_agent([{"Text": "ok"}])
    config["Agents"]["other"] = config["Agents"]["demo"]
    rt = make(make_runtime, sql_url, thread_worker, Agents=config["Agents"])
    client = create_app(rt, {"TESTING": True}).test_client()
    key = rt.tenants.issue_key(rt.tenants.ensure_tenant("acme")).secret
    assert post(client, key).status_code == 200

    response = post(client, key, path="/api/agents/other/run")

    assert response.status_code == 422
    assert len(runs_of(rt)) == 1


def test_422_is_decided_before_409(client: FlaskClient, key: str, runtime: Runtime) -> None:
    # Given the key reserved (in progress) by a request with another body
    tenant = runtime.tenants.find_tenant("acme")
    assert tenant is not None
    IdempotencyStore(runtime.db).reserve(tenant, "k-1", "POST", PATH, b'{"message": "other"}')

    assert post(client, key).status_code == 422
    assert post(client, key, body=b'{"message": "other"}').status_code == 409


# -- refused keys -----------------------------------------------------------------------


@pytest.mark.parametrize("idem", ["", "   "])
def test_empty_key_is_400_and_nothing_is_reserved(
    client: FlaskClient, key: str, runtime: Runtime, idem: str
) -> None:
    response = post(client, key, idem=idem)

    assert response.status_code == 400
    assert response.get_json()["field"] == "Idempotency-Key"
    assert records(runtime) == [] and runs_of(runtime) == []


def test_key_of_max_length_is_accepted_and_one_longer_is_400(
    client: FlaskClient, key: str, runtime: Runtime
) -> None:
    assert runtime.settings.idempotency.max_key_length == 255

    too_long = post(client, key, idem="x" * 256)
    exact = post(client, key, idem="x" * 255)

    assert too_long.status_code == 400 and "255" in too_long.get_json()["detail"]
    assert exact.status_code == 200
    assert [r.key for r in records(runtime)] == ["x" * 255]


def test_key_with_stream_true_is_400_and_nothing_is_reserved(
    client: FlaskClient, key: str, runtime: Runtime
) -> None:
    agent = post(client, key, body=b'{"message": "x", "stream": true}')
    chat = post(
        client,
        key,
        body=b'{"model": "demo", "stream": true, "messages": [{"role": "user", "content": "x"}]}',
        path="/v1/chat/completions",
    )

    assert agent.status_code == chat.status_code == 400
    assert chat.get_json()["error"]["code"] == "invalid_idempotency_key"
    assert records(runtime) == [] and runs_of(runtime) == []


def test_disabled_idempotency_with_the_header_is_501_and_does_not_execute(
    make_runtime: MakeRuntime, sql_url: str, thread_worker: ThreadWorker
) -> None:
    rt = make(make_runtime, sql_url, thread_worker, Idempotency={"Enabled": False})
    client = create_app(rt, {"TESTING": True}).test_client()
    key = rt.tenants.issue_key(rt.tenants.ensure_tenant("acme")).secret

    response = post(client, key)

    assert response.status_code == 501
    assert runs_of(rt) == [] and records(rt) == []
    assert post(client, key, idem=None, Prefer="respond-async").status_code == 202


# -- non-2xx and exceptions release -----------------------------------------------------


def test_a_failed_run_is_not_stored_and_a_retry_executes_again(
    make_runtime: MakeRuntime, sql_url: str, thread_worker: ThreadWorker
) -> None:
    failing = {"scripted": {"Kind": "scripted", "Script": [{"ErrorStatus": 400}]}}
    rt = make(make_runtime, sql_url, thread_worker, Providers=failing)
    client = create_app(rt, {"TESTING": True}).test_client()
    key = rt.tenants.issue_key(rt.tenants.ensure_tenant("acme")).secret

    first = post(client, key)
    retry = post(client, key)

    assert first.status_code == retry.status_code == 502
    assert first.get_json()["status"] == "Failed"
    assert first.get_json()["id"] != retry.get_json()["id"]
    assert "Idempotency-Replayed" not in retry.headers
    assert records(rt) == []


def test_an_error_answer_releases_the_reservation(
    client: FlaskClient, key: str, runtime: Runtime
) -> None:
    def refuse(run_id: str) -> None:
        raise EnqueueError("broker down")

    working = runtime.dispatcher.send
    runtime.send_runs_with(refuse)
    assert post(client, key).status_code == 503
    assert records(runtime) == []

    runtime.send_runs_with(working)
    assert post(client, key).status_code == 200


def test_an_exception_releases_the_reservation(
    client: FlaskClient, key: str, runtime: Runtime
) -> None:
    def explode(run_id: str) -> None:
        raise RuntimeError("a bug")

    runtime.send_runs_with(explode)

    with pytest.raises(RuntimeError):
        post(client, key)

    assert records(runtime) == []


def test_a_bad_body_with_a_key_is_400_and_released(
    client: FlaskClient, key: str, runtime: Runtime
) -> None:
    assert post(client, key, body=b'{"message": ""}').status_code == 400
    assert records(runtime) == []


# -- buffered response statuses ---------------------------------------------------------


def test_a_run_that_exhausts_its_quota_answers_429(
    make_runtime: MakeRuntime, sql_url: str, thread_worker: ThreadWorker
) -> None:
    looping = [{"ToolCalls": [{"Name": "lookup_order", "Arguments": {"order_id": "A-1"}}]}]
    config = scripted_agent(looping, ["lookup_order"])
    rt = make(make_runtime, sql_url, thread_worker, **config, Runs={"MaxTurns": 1})
    client = create_app(rt, {"TESTING": True}).test_client()
    key = rt.tenants.issue_key(rt.tenants.ensure_tenant("acme")).secret

    response = post(client, key)

    assert response.status_code == 429
    assert response.get_json()["error"]["class"] == "QuotaExceeded"
    assert records(rt) == []


def test_a_run_still_going_after_the_buffered_wait_answers_202_and_replays_it(
    make_runtime: MakeRuntime, sql_url: str, thread_worker: ThreadWorker
) -> None:
    rt = make(
        make_runtime,
        sql_url,
        thread_worker,
        Providers=slow_provider(2.0),
        Runs={"BufferedWaitTimeout": 0.3},
    )
    client = create_app(rt, {"TESTING": True}).test_client()
    key = rt.tenants.issue_key(rt.tenants.ensure_tenant("acme")).secret

    first = post(client, key)
    again = post(client, key)

    assert first.status_code == again.status_code == 202
    run_id = first.get_json()["id"]
    assert first.get_json()["status"] in ("Queued", "Running")
    assert first.headers["Location"] == again.headers["Location"] == f"/api/runs/{run_id}"
    assert again.data == first.data and again.headers["Idempotency-Replayed"] == "true"
    assert len(runs_of(rt)) == 1


def test_a_canceled_run_answers_409_and_is_not_stored(
    client: FlaskClient, key: str, runtime: Runtime
) -> None:
    runtime.send_runs_with(hold_queued)
    answers: list[Any] = []
    caller = threading.Thread(target=lambda: answers.append(post(client, key)))
    caller.start()
    wait_until(
        lambda: any(r.run_id for r in records(runtime)), what="the run to be recorded", timeout=10
    )
    run_id = records(runtime)[0].run_id

    cancel = client.post(f"/api/runs/{run_id}/cancel", headers=headers(key, idem=None))
    caller.join(10)

    assert cancel.status_code == 202
    assert answers[0].status_code == 409 and answers[0].get_json()["status"] == "Canceled"
    assert records(runtime) == []


@pytest.mark.parametrize(
    ("status", "error_type", "error_class", "expected", "header"),
    [
        ("Completed", None, None, 200, None),
        ("Canceled", "canceled", "Cancellation", 409, None),
        ("Failed", "provider_unavailable", "Provider", 503, "Retry-After"),
        ("Failed", "run_budget_exceeded", "QuotaExceeded", 429, None),
        ("Failed", "provider_error", "Provider", 502, None),
        ("Running", None, None, 202, "Location"),
        ("Waiting", None, None, 202, "Location"),
    ],
)
def test_buffered_status_follows_the_runs_end(
    runtime: Runtime,
    status: str,
    error_type: str | None,
    error_class: str | None,
    expected: int,
    header: str | None,
) -> None:
    from web.buffered import ending

    run = Run(id="r-1", status=status, error_type=error_type, error_class=error_class)
    with create_app(runtime, {"TESTING": True}).app_context():
        end = ending(run)

    assert end.status == expected
    assert end.ok == (200 <= expected < 300)
    if header is not None:
        assert header in end.headers
    if header == "Retry-After":
        assert end.headers["Retry-After"] == "30"  # CircuitBreaker.BreakDuration


# -- tenants, and no header at all ------------------------------------------------------


def test_the_same_key_in_another_tenant_is_another_key(
    client: FlaskClient, key: str, runtime: Runtime
) -> None:
    other = runtime.tenants.issue_key(runtime.tenants.ensure_tenant("globex")).secret
    mine = post(client, key)

    theirs = post(client, other)
    theirs_different_body = post(client, other, body=b'{"message": "x"}', idem="k-2")

    assert theirs.status_code == 200 and "Idempotency-Replayed" not in theirs.headers
    assert theirs.get_json()["id"] != mine.get_json()["id"]
    assert theirs_different_body.status_code == 200
    assert len(runs_of(runtime)) == 3


def test_a_request_without_the_header_streams_and_never_queries_the_store(
    client: FlaskClient, key: str, runtime: Runtime
) -> None:
    statements: list[str] = []

    def seen(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        statements.append(statement)

    sa.event.listen(runtime.db.engine, "before_cursor_execute", seen)
    try:
        response = client.post(PATH, data=BODY, headers=headers(key, idem=None), buffered=False)
        streamed = response.is_streamed
        body = response.get_data(as_text=True)
    finally:
        sa.event.remove(runtime.db.engine, "before_cursor_execute", seen)

    assert streamed and response.mimetype == "text/event-stream"
    assert "RunCompleted" in body
    assert statements and not [s for s in statements if "idempotency" in s.lower()]


# The routes that accept a key only with Prefer: respond-async (the workflow routes) are
# tested on the real routes in test_workflows_http.py.


# -- a drain stops new work, not replays ---------------------------------------------------

CHAT = {"model": "demo", "messages": [{"role": "user", "content": "Where is A-1?"}]}
SUBMISSIONS = [
    ("/api/agents/demo/run", {"message": "Where is A-1?"}),
    ("/api/workflows/paid/run", {"input": {}}),
    ("/v1/chat/completions", CHAT),
    ("/v1/responses", {"model": "demo", "input": "Where is A-1?"}),
]


def test_a_draining_node_replays_stored_answers_and_refuses_new_keys(
    make_runtime: MakeRuntime, sql_url: str
) -> None:
    # Given four submissions answered 202 with a key each, then the node starts draining
    config = scripted_agent([{"Text": "It shipped."}])
    runtime = make_runtime(
        sql_url, sender=hold_queued, WorkflowModules=["tests.workflows"], **config
    )
    api_key = runtime.tenants.issue_key(runtime.tenants.ensure_tenant("acme")).secret
    live = create_app(runtime, {"TESTING": True}).test_client()
    draining = create_app(runtime, {"TESTING": True, "TRACON_DRAINING": True}).test_client()

    def submit(client: FlaskClient, path: str, body: Any, idem: str) -> Any:
        return client.post(path, json=body, headers=headers(api_key, idem, Prefer="respond-async"))

    first = [submit(live, path, body, f"first-{i}") for i, (path, body) in enumerate(SUBMISSIONS)]
    assert [response.status_code for response in first] == [202] * 4

    # When each is retried with its key, and sent with a new one, on the draining node
    retries = [submit(draining, p, b, f"first-{i}") for i, (p, b) in enumerate(SUBMISSIONS)]
    fresh = [submit(draining, p, b, f"new-{i}") for i, (p, b) in enumerate(SUBMISSIONS)]

    # Then the retries get what was stored, and the new keys the drain's 503
    for original, retry in zip(first, retries, strict=True):
        assert retry.status_code == 202, retry.get_data(as_text=True)[:300]
        assert retry.headers["Idempotency-Replayed"] == "true"
        assert retry.get_data() == original.get_data()
    for (path, _), refused in zip(SUBMISSIONS, fresh, strict=True):
        assert refused.status_code == 503 and refused.headers["Retry-After"] == "5"
        if path.startswith("/v1/"):
            error = refused.get_json()["error"]
            assert (error["type"], error["code"]) == ("service_unavailable", "service_unavailable")
        else:
            assert refused.get_json()["code"] == "service_unavailable"
    assert (len(runs_of(runtime)), len(records(runtime))) == (4, 4), "nothing new was written"


def test_v1_responses_on_a_draining_node_is_503_in_openai_shape(
    make_runtime: MakeRuntime, sql_url: str
) -> None:
    runtime = make_runtime(sql_url, sender=hold_queued, **scripted_agent([{"Text": "x"}]))
    api_key = runtime.tenants.issue_key(runtime.tenants.ensure_tenant("acme")).secret
    client = create_app(runtime, {"TESTING": True, "TRACON_DRAINING": True}).test_client()

    response = client.post(
        "/v1/responses", json={"model": "demo", "input": "x"}, headers=headers(api_key, None)
    )

    assert response.status_code == 503 and response.headers["Retry-After"] == "5"
    assert response.mimetype == "application/json"
    assert response.get_json() == {
        "error": {
            "message": "this node is draining before it stops; retry shortly",
            "type": "service_unavailable",
            "param": None,
            "code": "service_unavailable",
        }
    }
    assert runs_of(runtime) == []
