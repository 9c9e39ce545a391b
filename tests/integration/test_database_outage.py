"""A database that does not answer: the web answers 503 problem+json with Retry-After (as for
a Redis outage, never a 500), `/readyz` says which store is down, and an executor's SQL call
is retried until the database is back, within `Database.OutageRetry`."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from flask.testing import FlaskClient
from sqlalchemy.exc import OperationalError
from werkzeug.test import TestResponse

from tests.helpers import MakeRuntime, auth, hold_queued, scripted_agent
from tracon_jobs.db.outages import retry_outages
from tracon_jobs.embedded_redis import start_embedded
from web import create_app

DEAD = "postgresql+psycopg://postgres@127.0.0.1:1/tracon"


def test_the_web_answers_503_with_retry_after_when_sql_does_not_answer(
    make_runtime: MakeRuntime,
) -> None:
    runtime = make_runtime(DEAD, **scripted_agent([]))
    client = create_app(runtime, {"TESTING": True}).test_client()

    response = client.get("/api/runs", headers={"Authorization": "Bearer tjk_abc_def"})
    ready = client.get("/readyz")

    assert response.status_code == 503 and response.headers["Retry-After"] == "5"
    assert response.mimetype == "application/problem+json"
    assert response.get_json()["code"] == "database_unavailable"
    assert ready.status_code == 503
    assert ready.get_json()["checks"] == {"sql": False, "redis": True}


class Flaky:
    """Fails like a dropped connection until `back` is set."""

    outage_retry_seconds = 2.0

    def __init__(self) -> None:
        self.back = threading.Event()
        self.calls = 0

    def call(self) -> str:
        self.calls += 1
        if not self.back.is_set():
            raise OperationalError("SELECT 1", None, Exception("server closed the connection"))
        return "written"


def test_a_call_is_retried_until_the_database_is_back() -> None:
    flaky = Flaky()
    threading.Timer(0.4, flaky.back.set).start()

    assert retry_outages(flaky, flaky.call, "a write") == "written"
    assert flaky.calls > 2


def test_retries_stop_at_the_outage_budget() -> None:
    flaky = Flaky()
    flaky.outage_retry_seconds = 0.3
    started = time.monotonic()

    with pytest.raises(OperationalError):
        retry_outages(flaky, flaky.call, "a write")
    assert time.monotonic() - started < 5


# -- a Redis that stopped, and /v1 during an outage ------------------------------------


@pytest.fixture
def stopped_redis(
    make_runtime: MakeRuntime, sqlite_url: str, tmp_path: Path
) -> tuple[FlaskClient, str, str]:
    """(client, API key, id of a run written while Redis answered): an app on a Redis
    server of its own, stopped once the run is written."""
    server = start_embedded(tmp_path / "redis")
    try:
        runtime = make_runtime(
            sqlite_url, sender=hold_queued, Redis={"Url": server.url}, **scripted_agent([])
        )
        client = create_app(runtime, {"TESTING": True}).test_client()
        key = runtime.tenants.issue_key(runtime.tenants.ensure_tenant("acme")).secret
        written = client.post(
            "/api/agents/demo/run",
            json={"message": "x"},
            headers=auth(key, Prefer="respond-async"),
        )
        assert written.status_code == 202
    finally:
        server.stop()
    return client, key, written.get_json()["runId"]


def test_every_streaming_answer_is_503_with_retry_after_while_redis_is_down(
    stopped_redis: tuple[FlaskClient, str, str],
) -> None:
    client, key, run_id = stopped_redis

    submitted = client.post("/api/agents/demo/run", json={"message": "x"}, headers=auth(key))
    followed = client.get(
        f"/api/runs/{run_id}/events", headers=auth(key, Accept="text/event-stream")
    )
    chat = client.post(
        "/v1/chat/completions",
        json={"model": "demo", "messages": [{"role": "user", "content": "x"}], "stream": True},
        headers=auth(key),
    )
    listed = client.get("/api/runs", headers=auth(key)).get_json()["items"]

    for response in (submitted, followed):
        assert response.status_code == 503, response.get_data(as_text=True)[:300]
        assert response.headers["Retry-After"] == "5"
        assert response.mimetype == "application/problem+json"
        assert response.get_json()["code"] == "redis_unavailable"
    assert chat.status_code == 503, chat.get_data(as_text=True)[:300]
    assert chat.headers["Retry-After"] == "5"
    assert openai_error(chat) == {
        "message": "Redis is not answering; retry shortly",
        "type": "service_unavailable",
        "param": None,
        "code": "redis_unavailable",
    }
    assert [run["id"] for run in listed] == [run_id], "a refused stream writes no run"


def openai_error(response: TestResponse) -> dict[str, object]:
    """The `error` object of an answer in OpenAI's shape (and nothing else in the body)."""
    assert response.mimetype == "application/json", response.get_data(as_text=True)[:300]
    body = response.get_json()
    assert set(body) == {"error"}
    error: dict[str, object] = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("GET", "/v1/models", None),
        ("POST", "/v1/chat/completions", {"model": "demo", "messages": [{"role": "user"}]}),
        ("POST", "/v1/responses", {"model": "demo", "input": "x"}),
    ],
    ids=["models", "chat", "responses"],
)
def test_v1_answers_a_database_outage_in_openai_shape(
    make_runtime: MakeRuntime, method: str, path: str, body: dict[str, object] | None
) -> None:
    runtime = make_runtime(DEAD, **scripted_agent([]))
    client = create_app(runtime, {"TESTING": True}).test_client()

    response = client.open(path, method=method, json=body, headers=auth("tjk_abc_def"))

    assert response.status_code == 503 and response.headers["Retry-After"] == "5"
    assert openai_error(response) == {
        "message": "the database is not answering; retry shortly",
        "type": "service_unavailable",
        "param": None,
        "code": "database_unavailable",
    }
