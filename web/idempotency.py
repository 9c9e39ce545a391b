"""`Idempotency-Key` on the routes that accept it: reserve, execute once, store the 2xx, replay.

    @bp.post("/agents/<name>/run")
    @idempotent()
    def run_agent(name): ...

Without the header the wrapper only looks the header up: no body is buffered and the
store is never queried. With it: 501 when idempotency is disabled; 400 for an empty or
too long key, a body with `stream: true`, or (workflow routes) no `Prefer: respond-async`;
then one reservation decides between executing, 422, 409 and the replay. A non-2xx answer
or an exception releases the reservation so that a retry can execute.

A check that stops new work only (a drain, a spent quota: `before_new_work`) runs after that
decision on a route that takes a key: a replay answers what was decided, and a refusal
releases the reservation like any other error answer.

Errors are raised as `Problem`s; the `/v1` blueprint renders them in OpenAI's shape.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar, cast

from flask import Response, current_app, g, request

from tracon_jobs import metrics
from tracon_jobs.idempotency import IdempotencyStore, Outcome, StoredResponse
from web import inputs
from web.auth import tenant_id
from web.extensions import runtime
from web.preferences import prefers_async
from web.problems import Problem

log = logging.getLogger(__name__)

HEADER = "Idempotency-Key"
REPLAYED = "Idempotency-Replayed"

View = TypeVar("View", bound=Callable[..., Any])
NEW_WORK_CHECKS = "tracon_new_work_checks"
"""Where `before_new_work` leaves the checks `execute_once` runs after the replay decision."""

_keyed_views: set[Callable[..., Any]] = set()


@dataclass(frozen=True)
class Held:
    """The reservation this request holds."""

    store: IdempotencyStore
    tenant_id: str
    key: str


def has_key() -> bool:
    return HEADER in request.headers


def idempotent(*, require_async: bool = False) -> Callable[[View], View]:
    """Make a submission route idempotent under `Idempotency-Key` (see the module doc)."""

    def wrap(view: View) -> View:
        @functools.wraps(view)
        def guarded(*args: Any, **kwargs: Any) -> Any:
            if HEADER not in request.headers:
                return view(*args, **kwargs)
            return execute_once(lambda: view(*args, **kwargs), require_async)

        _keyed_views.add(guarded)
        return cast(View, guarded)

    return wrap


def execute_once(call: Callable[[], Any], require_async: bool) -> Response:
    key = checked_key(require_async)
    held = Held(IdempotencyStore(runtime().db), tenant_id(), key)
    body = request.get_data(cache=True)
    reservation = held.store.reserve(held.tenant_id, key, request.method, request.path, body)
    metrics.idempotency_outcome(reservation.outcome.value)
    if reservation.outcome is Outcome.REPLAY:
        assert reservation.stored is not None
        return replay(reservation.stored)
    if reservation.outcome is Outcome.MISMATCH:
        raise Problem(
            422,
            "Unprocessable Entity",
            "this Idempotency-Key was used with a different method, path or body; "
            "reuse the original bytes or issue a new key",
            code="idempotency_key_reused",
        )
    if reservation.outcome is Outcome.IN_PROGRESS:
        raise Problem(
            409,
            "Conflict",
            "a request with this Idempotency-Key is still in progress",
            code="idempotency_key_in_progress",
        )
    g.idempotency = held
    return run_reserved(held, lambda: admitted(call))


def before_new_work(check: Callable[[], None]) -> None:
    """Run `check` (it raises to refuse) now, or, for a request with a key on a route that
    takes one, once the reservation is made: a stored answer is replayed whatever `check`
    would say, since a replay starts nothing."""
    if has_key() and current_app.view_functions.get(request.endpoint or "") in _keyed_views:
        g.setdefault(NEW_WORK_CHECKS, []).append(check)
    else:
        check()


def admitted(call: Callable[[], Any]) -> Any:
    """`call` once every deferred new-work check let it through."""
    for check in g.pop(NEW_WORK_CHECKS, []):
        check()
    return call()


def checked_key(require_async: bool) -> str:
    if not runtime().settings.idempotency.enabled:
        raise Problem(
            501,
            "Not Implemented",
            "Idempotency-Key is not accepted: Tracon:Idempotency:Enabled is false",
            code="idempotency_disabled",
        )
    key = request.headers.get(HEADER, "")
    limit = runtime().settings.idempotency.max_key_length
    if not key.strip():
        raise key_problem("Idempotency-Key must not be empty")
    if len(key) > limit:
        raise key_problem(f"Idempotency-Key is longer than {limit} characters")
    if streams():
        raise key_problem("Idempotency-Key cannot be used with stream: true")
    if require_async and not prefers_async():
        raise key_problem("Idempotency-Key on this route needs Prefer: respond-async")
    return key


def key_problem(detail: str) -> Problem:
    return Problem(400, "Bad Request", detail, field=HEADER, code="invalid_idempotency_key")


def streams() -> bool:
    """Whether the body asks for a stream (`"stream": true`), which cannot be replayed."""
    try:
        body = inputs.loads(request.get_data(cache=True) or b"null")
    except Problem:  # not a body this API accepts: the route's parse_body says why
        return False
    return isinstance(body, dict) and body.get("stream") is True


def run_reserved(held: Held, call: Callable[[], Any]) -> Response:
    try:
        response = current_app.make_response(call())
    except BaseException:
        release(held)
        raise
    if 200 <= response.status_code < 300 and not response.is_streamed:
        store(held, response)
    else:
        release(held)
    return response


def store(held: Held, response: Response) -> None:
    stored = StoredResponse(
        status=response.status_code,
        body=response.get_data(),
        content_type=response.content_type,
        location=response.headers.get("Location"),
        preference_applied=response.headers.get("Preference-Applied"),
        run_id=g.get("idempotency_run_id"),
    )
    if not held.store.complete(held.tenant_id, held.key, stored):
        log.warning("idempotency key %r was released before its response was stored", held.key)


def release(held: Held) -> None:
    try:
        held.store.release(held.tenant_id, held.key)
    except Exception:  # the original error matters more; the record waits for an operator
        log.exception("could not release idempotency key %r", held.key)


def remember_run(run_id: str) -> None:
    """Record the run a reserved request started, so the record (and an operator) knows it."""
    held: Held | None = g.get("idempotency")
    if held is None:
        return
    g.idempotency_run_id = run_id
    held.store.attach_run(held.tenant_id, held.key, run_id)


def replay(stored: StoredResponse) -> Response:
    response = Response(stored.body, status=stored.status, content_type=stored.content_type)
    if stored.location:
        response.headers["Location"] = stored.location
    if stored.preference_applied:
        response.headers["Preference-Applied"] = stored.preference_applied
    response.headers[REPLAYED] = "true"
    return response
