"""A run's message: `tracon.runs.execute` on the `tracon.runs` queue, sent by Celery's
`send_task`, or built by Celery and pushed as kombu's Redis transport pushes it (the
`envelope` fast path: one `LPUSH`).

`celery_sender` is the `Sender` (`runs.dispatch`) the composition root gives the run
dispatcher; a message that the broker did not take raises `EnqueueError`.
"""

from __future__ import annotations

import base64
import logging
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import redis
from kombu import serialization
from kombu.entity import PERSISTENT_DELIVERY_MODE
from kombu.utils import json as kombu_json
from kombu.utils.uuid import uuid

from tracon_jobs import metrics, tracing
from tracon_jobs.coordination.connections import command
from tracon_jobs.errors import EnqueueError
from tracon_jobs.runs.dispatch import Sender

if TYPE_CHECKING:
    from celery import Celery

log = logging.getLogger(__name__)

EXECUTE_TASK = "tracon.runs.execute"
RUNS_QUEUE = "tracon.runs"
TRACEPARENT = "traceparent"
"""The message header of the sender's W3C trace context (`tracing`), when it traces."""
SHOWN_MAX = 1024  # Celery's `argsrepr_maxsize`: longer arguments are cut by its saferepr
SEND_RETRIES = 2
SEND_RETRY_STEP_SECONDS = 0.2
"""A message the broker did not take is tried twice more, at once and 0.2 s later."""

Labels = Callable[[str], tuple[str, str] | None]
"""`labels(run_id)`: the run's (agent, tenant name), or None when unknown."""

_labels: weakref.WeakKeyDictionary[Celery, Labels] = weakref.WeakKeyDictionary()


def label_runs_with(app: Celery, labels: Labels) -> None:
    """Messages `celery_sender(app)` sends name their run's agent and tenant from `labels`
    (`create_celery(..., describe=...)` sets it)."""
    _labels[app] = labels


def celery_sender(
    app: Celery, labels: Labels | None = None, *, client: redis.Redis | None = None
) -> Sender:
    """Send `tracon.runs.execute(run_id=..., agent=..., tenant=...)`; a broker that is down
    fails within a second.

    The keyword arguments are what Flower lists for the task; the worker also accepts the
    older positional `[run_id]`. The agent and tenant come from `labels` (else the one
    registered for `app`); a run they cannot be read for is sent with its id alone.

    With `client` (a client of the broker's Redis), the message is built by Celery
    (`as_task_v2`, the same headers, properties and body as `send_task`'s) and pushed as
    kombu's Redis transport pushes a message to a queue: one `LPUSH` of the same envelope.
    `send_task` spends about 0.2 ms of CPU a message on its way there (routing, the
    producer pool, declaring the queue, kombu's publish), two thirds of it avoidable: the
    web pays it on every submission.
    """
    push = None if client is None else _pusher(app, client)

    def send(run_id: str) -> None:
        kwargs, shown_or_cut = _arguments(app, labels, run_id)
        traceparent = tracing.current_traceparent()  # the sender's span: the run's, or a link
        try:
            if push is not None:
                push(kwargs, shown_or_cut, traceparent)
            else:
                app.send_task(
                    EXECUTE_TASK,
                    kwargs=kwargs,
                    argsrepr="()",
                    kwargsrepr=shown_or_cut,
                    headers=None if traceparent is None else {TRACEPARENT: traceparent},
                    queue=RUNS_QUEUE,
                    retry=True,
                    retry_policy={
                        "max_retries": SEND_RETRIES,
                        "interval_start": 0,
                        "interval_step": SEND_RETRY_STEP_SECONDS,
                        "interval_max": 0.5,
                    },
                )
        except Exception as exc:  # kombu raises many types for a broker it cannot reach
            metrics.message_sent(ok=False)
            raise EnqueueError(f"the broker did not accept run {run_id}: {exc}") from exc
        metrics.message_sent(ok=True)

    return send


def celery_message(app: Celery, labels: Labels | None = None) -> Callable[[str], str]:
    """`message(run_id)`: the run's message as `celery_sender` with a client pushes it (the
    fair lines keep it and push it themselves, `coordination.fair_share`)."""
    build = _builder(app)

    def message(run_id: str) -> str:
        return build(*_arguments(app, labels, run_id), tracing.current_traceparent())

    return message


def _arguments(
    app: Celery, labels: Labels | None, run_id: str
) -> tuple[dict[str, str], str | None]:
    kwargs: dict[str, str] = {"run_id": run_id}
    found = _find_labels(labels or _labels.get(app), run_id)
    if found is not None:
        kwargs["agent"], kwargs["tenant"] = found
    shown = repr(kwargs)  # what Celery's saferepr gives short strings, at a tenth the cost
    return kwargs, shown if len(shown) <= SHOWN_MAX else None  # None: Celery cuts it


Build = Callable[[dict[str, str], str | None, str | None], str]
"""`build(kwargs, kwargsrepr, traceparent)`: the envelope of one run's message."""


def _pusher(
    app: Celery, client: redis.Redis
) -> Callable[[dict[str, str], str | None, str | None], None]:
    """`push(kwargs, kwargsrepr, traceparent)`: one `tracon.runs.execute` message on
    `RUNS_QUEUE`."""
    build = _builder(app)

    def push(kwargs: dict[str, str], kwargsrepr: str | None, traceparent: str | None) -> None:
        envelope = build(kwargs, kwargsrepr, traceparent)
        for attempt in range(SEND_RETRIES + 1):
            try:
                command(client, "LPUSH", RUNS_QUEUE, envelope)
                return
            except (redis.ConnectionError, redis.TimeoutError):
                if attempt == SEND_RETRIES:
                    raise
                time.sleep(SEND_RETRY_STEP_SECONDS * attempt)

    return push


def _builder(app: Celery) -> Build:
    """`build(kwargs, kwargsrepr, traceparent)`: the envelope of one `tracon.runs.execute`
    message (with a `traceparent` header, as `send_task(headers=...)` adds one)."""
    amqp = app.amqp

    def build(kwargs: dict[str, str], kwargsrepr: str | None, traceparent: str | None) -> str:
        task_id = uuid()
        parent = app.current_worker_task  # a run sent by a run: its task's child, as Celery
        root_id = parent_id = None
        if parent is not None:
            root_id = parent.request.root_id or parent.request.id
            parent_id = parent.request.id
        message = amqp.as_task_v2(
            task_id,
            EXECUTE_TASK,
            kwargs=kwargs,
            reply_to=app.thread_oid,
            root_id=root_id,
            parent_id=parent_id,
            ignore_result=None,
            argsrepr="()",
            kwargsrepr=kwargsrepr,
        )
        # `send_task` also copies the reprs into the properties: the same envelope
        properties = {**message.properties, "argsrepr": "()", "kwargsrepr": kwargsrepr}
        headers = message.headers
        if traceparent is not None:
            headers = {**headers, TRACEPARENT: traceparent}
        return _envelope(headers, properties, message.body)

    return build


def _envelope(headers: dict[str, Any], properties: dict[str, Any], body: Any) -> str:
    """The message as kombu's virtual transport lays it out in a Redis list (JSON, the body
    base64), with the properties kombu's producer adds: persistent, priority 0, and where it
    was published (the default exchange, the queue's name as its routing key)."""
    content_type, content_encoding, payload = serialization.dumps(body, serializer="json")
    return kombu_json.dumps(
        {
            "body": base64.b64encode(payload.encode()).decode(),
            "content-encoding": content_encoding,
            "content-type": content_type,
            "headers": headers,
            "properties": {
                **properties,
                "delivery_mode": PERSISTENT_DELIVERY_MODE,
                "delivery_info": {"exchange": "", "routing_key": RUNS_QUEUE},
                "priority": 0,
                "body_encoding": "base64",
                "delivery_tag": uuid(),
            },
        }
    )


def _find_labels(labels: Labels | None, run_id: str) -> tuple[str, str] | None:
    if labels is None:
        return None
    try:
        return labels(run_id)
    except Exception as exc:  # labels are for people; the message must still go
        log.warning("run %s: sent without agent and tenant: %s", run_id, exc)
        return None
