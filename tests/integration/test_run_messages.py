"""A run's message pushed straight to the broker's Redis (`celery_sender(..., client=)`) is the
message Celery's `send_task` writes there, but for the ids each message gets anew; sent from
inside a task it is that task's child, as Celery makes it; a broker that is down is an
`EnqueueError` within a second."""

from __future__ import annotations

import base64
import json
import time
from typing import Any

import pytest
import redis
from celery import Celery

from tests.helpers import MakeRuntime, scripted_agent
from tracon_jobs.embedded_redis import free_port
from tracon_jobs.errors import EnqueueError
from tracon_jobs.runs.store import NewRun, RunFilter
from tracon_jobs.worker.envelope import RUNS_QUEUE, celery_sender

PER_MESSAGE = {"id", "root_id", "correlation_id", "delivery_tag"}


def labels(_run_id: str) -> tuple[str, str]:
    return "demo", "acme"


def sent(client: redis.Redis) -> list[dict[str, Any]]:
    """The queue's messages, oldest first."""
    raw: Any = client.lrange(RUNS_QUEUE, 0, -1)
    return [json.loads(message) for message in reversed(raw)]


def without_ids(message: dict[str, Any]) -> dict[str, Any]:
    return {
        **message,
        "headers": {k: v for k, v in message["headers"].items() if k not in PER_MESSAGE},
        "properties": {k: v for k, v in message["properties"].items() if k not in PER_MESSAGE},
    }


@pytest.fixture
def app(make_runtime: MakeRuntime, sqlite_url: str) -> Celery:
    return make_runtime(sqlite_url, **scripted_agent([{"Text": "hi"}])).celery


def test_the_pushed_message_is_the_one_send_task_writes(
    app: Celery, redis_client: redis.Redis
) -> None:
    redis_client.delete(RUNS_QUEUE)
    celery_sender(app, labels)("run-1")
    celery_sender(app, labels, client=redis_client)("run-1")

    theirs, ours = sent(redis_client)
    assert without_ids(ours) == without_ids(theirs)
    assert ours["headers"]["id"] != theirs["headers"]["id"]
    assert (
        ours["headers"]["root_id"] == ours["headers"]["id"] == ours["properties"]["correlation_id"]
    )
    assert json.loads(base64.b64decode(ours["body"]))[1] == {
        "run_id": "run-1",
        "agent": "demo",
        "tenant": "acme",
    }


def test_a_run_sent_from_inside_a_task_is_its_child(app: Celery, redis_client: redis.Redis) -> None:
    redis_client.delete(RUNS_QUEUE)
    ours = celery_sender(app, labels, client=redis_client)
    theirs = celery_sender(app, labels)

    @app.task(name="test.parent", shared=False, bind=True)
    def parent(task: Any) -> str:
        ours("child-1")
        theirs("child-1")
        return str(task.request.id)

    parent_id = parent.apply(task_id="the-parent").get()

    pushed, published = sent(redis_client)
    assert parent_id == "the-parent"
    for message in (pushed, published):
        assert message["headers"]["parent_id"] == "the-parent"
        assert message["headers"]["root_id"] == "the-parent"
    assert without_ids(pushed) == without_ids(published)


def test_a_broker_that_is_down_is_an_enqueue_error_within_a_second(
    make_runtime: MakeRuntime, sqlite_url: str
) -> None:
    """The runtime's own client: the run is closed `enqueue_failed` (the web answers 503)."""
    down = f"redis://127.0.0.1:{free_port()}/0"
    runtime = make_runtime(sqlite_url, Redis={"Url": down}, **scripted_agent([{"Text": "hi"}]))
    tenant = runtime.tenants.ensure_tenant("acme")
    started = time.monotonic()
    with pytest.raises(EnqueueError, match="did not accept run"):
        runtime.dispatcher.submit(NewRun(tenant, "demo", {"message": "x"}))
    assert time.monotonic() - started < 1.0
    (run,) = runtime.runs.page(tenant, RunFilter(), limit=10, before=None)
    assert (run.status, run.error_type) == ("Failed", "enqueue_failed")


def test_the_runtime_pushes_and_a_worker_runs_what_it_pushed(
    make_runtime: MakeRuntime, sqlite_url: str, redis_client: redis.Redis
) -> None:
    """The web's and the worker's sends go straight to Redis; the message is one Celery's
    worker takes (its strategy reads the task name, id and kwargs from it)."""
    runtime = make_runtime(sqlite_url, **scripted_agent([{"Text": "hi"}]))
    redis_client.delete(RUNS_QUEUE)
    tenant = runtime.tenants.ensure_tenant("acme")
    run = runtime.dispatcher.submit(NewRun(tenant, "demo", {"message": "x"}))

    (message,) = sent(redis_client)
    assert message["headers"]["task"] == "tracon.runs.execute"
    body = json.loads(base64.b64decode(message["body"]))
    assert body[1] == {"run_id": run.id, "agent": "demo", "tenant": "acme"}
    task = runtime.celery.tasks["tracon.runs.execute"]
    assert task.apply(kwargs=body[1]).get() == "Completed"
    done = runtime.runs.get(run.id)
    assert done is not None and done.status == "Completed"


def test_a_continuation_s_message_is_labelled_from_its_row_in_hand(
    make_runtime: MakeRuntime, sqlite_url: str, redis_client: redis.Redis
) -> None:
    """An answer's continuation (like a submission) is labelled for Flower with the run the
    answer made, not with a read of its row back."""
    sections: dict[str, Any] = {
        "WorkflowModules": ["tests.workflows"],
        "Workflows": {"EnableCheckpointing": True},
    }
    runtime = make_runtime(sqlite_url, **scripted_agent([{"Text": "hi"}]), **sections)
    tenant = runtime.tenants.ensure_tenant("acme")
    new = NewRun(tenant, "hundred", {}, kind="workflow", session_id="s", resumable=True)
    asking = runtime.dispatcher.submit(new)
    assert runtime.executor.execute(asking.id) == "Waiting"
    read_back: list[str] = []
    runtime.__dict__["_describe"] = lambda run_id: read_back.append(run_id)  # no row read
    redis_client.delete(RUNS_QUEUE)

    waiting = runtime.runs.get(asking.id)
    assert waiting is not None
    continuation = runtime.workflow_resumes.respond(waiting, "yes", resumable=True)

    (message,) = sent(redis_client)
    body = json.loads(base64.b64decode(message["body"]))
    assert body[1] == {"run_id": continuation.id, "agent": "hundred", "tenant": "acme"}
    assert read_back == []
