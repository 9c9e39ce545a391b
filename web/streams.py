"""Live event streams as answers: `live_stream`, and the tenant's places that bound them.

A stream holds one of its tenant's places (`Web.MaxStreamsPerTenant`, counted across every
web process) from the request until it ends; past the limit the answer is `429`, given
before a run-starting route writes anything. Under `tracon-jobs web` the connection goes to
the process's `StreamHub` once the head is sent; under any other server the answer's body
follows the run from the request's thread (`web.sse.followed`).
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

from flask import Flask, Response, current_app, request

from tracon_jobs import metrics
from tracon_jobs.coordination.streams import StreamPlace, StreamPlaces
from tracon_jobs.handoff import HANDOFF
from tracon_jobs.runs.cancel import cancel_tree
from tracon_jobs.runs.lifecycle import RunStatus
from tracon_jobs.runtime import Runtime
from web.auth import tenant_id
from web.continuing import Chain
from web.extensions import runtime
from web.problems import Problem
from web.sse import KEEPALIVE_SECONDS, Follow, followed, open_call, sse_response
from web.stream_hub import StreamHub, cancels_on_disconnect


def cancel_run(rt: Runtime, run_id: str) -> None:
    """Cancel a run whose streaming client went away (`Runs.CancelOnDisconnect`)."""
    run = rt.runs.get(run_id)
    if run is not None and not RunStatus(run.status).is_terminal:
        cancel_tree(rt.runs, rt.cancel_bus, rt.approval_store, run)


def follows_on(rt: Runtime) -> bool:
    """Whether orphans are continued here, so streams follow on into the continuation."""
    settings = rt.settings
    return settings.run_continuation.enabled and settings.run_reconciliation.enabled


def canceled_when_left(frames: Iterator[str], cancel: Callable[[], None]) -> Iterator[str]:
    """The stream's text; its run is canceled when the server closes it before its end (the
    client went away)."""
    ended = False
    try:
        yield from frames
        ended = True
    finally:
        if not ended:
            cancel()


class CountedPlaces(StreamPlaces):
    """Stream places, each taken, refused and given back one counted in `/metrics`."""

    def take(self, tenant_id: str) -> StreamPlace | None:
        place = super().take(tenant_id)
        metrics.live_stream("refused" if place is None else "opened")
        return place

    def give_back_all(self, places: Iterable[StreamPlace]) -> None:
        places = list(places)
        metrics.live_stream("closed", len(places))
        super().give_back_all(places)


def stream_places() -> StreamPlaces:
    app = current_app
    places: StreamPlaces | None = app.extensions.get("tracon_stream_places")
    if places is None:
        rt = runtime()
        places = CountedPlaces(rt.coordination, rt.settings.web.max_streams_per_tenant)
        app.extensions["tracon_stream_places"] = places
    return places


def stream_place() -> StreamPlace:
    """One of the tenant's live-stream places, or `429` when it holds all of them."""
    places = stream_places()
    place = places.take(tenant_id())
    if place is None:
        raise Problem(
            429,
            "Too Many Requests",
            f"this tenant already follows {places.limit} live event streams "
            "(Web.MaxStreamsPerTenant); close one, or poll with Prefer: respond-async",
            headers={"Retry-After": "1"},
            code="too_many_streams",
        )
    return place


@contextmanager
def place_for_stream(wanted: bool) -> Iterator[StreamPlace | None]:
    """A place taken before a run is submitted, so a `429` writes nothing; given back when
    the submission fails."""
    place = stream_place() if wanted else None
    try:
        yield place
    except BaseException:
        if place is not None:
            stream_places().give_back(place)
        raise


def live_stream(
    follow: Follow, after: int = 0, place: StreamPlace | None = None, **headers: Any
) -> Response:
    """The answer that follows `follow.run_id` live: handed to the stream hub when the
    server takes it, otherwise streamed from this thread."""
    if place is None:
        place = stream_place()
    places = stream_places()
    rt = runtime()
    keepalive = current_app.config.get("SSE_KEEPALIVE_SECONDS", KEEPALIVE_SECONDS)
    resume = open_call(rt.runs, rt.live_text, follow.run_id, after)
    renew = partial(places.renew, [place])
    chain = Chain(follows_on(rt))
    frames = followed(
        follow, rt.runs, rt.feed, after, keepalive, renew, rt.live_text, resume, chain
    )
    if cancels_on_disconnect(follow):
        frames = canceled_when_left(frames, partial(cancel_run, rt, follow.run_id))
    response = sse_response(frames, **headers)
    app = current_app._get_current_object()  # type: ignore[attr-defined]
    handoff = HubHandoff(lambda: stream_hub(app), follow, after, place, resume)
    request.environ[HANDOFF] = handoff

    def give_back() -> None:
        if not handoff.adopted:
            places.give_back(place)

    response.call_on_close(give_back)
    return response


class HubHandoff:
    """What a streaming answer puts in the WSGI environ: `adopt` hands its connection to
    the process's hub (see `tracon_jobs.handoff`)."""

    def __init__(
        self,
        hub: Callable[[], StreamHub],
        follow: Follow,
        after: int,
        place: StreamPlace,
        resume: int | None = None,
    ) -> None:
        self.hub = hub
        self.follow = follow
        self.after = after
        self.place = place
        self.resume = resume  # the call open at `after` (web.sse.open_call)
        self.adopted = False

    def adopt(self, sock: socket.socket, chunked: bool) -> None:
        self.hub().adopt(sock, self.follow, self.after, self.place, chunked, self.resume)
        self.adopted = True


_hubs_lock = threading.Lock()


def stream_hub(app: Flask) -> StreamHub:
    """The hub of this process for `app`, started on first use (after any fork)."""
    with _hubs_lock:
        found: tuple[int, StreamHub] | None = app.extensions.get("tracon_stream_hub")
        if found is not None and found[0] == os.getpid():
            return found[1]
        with app.app_context():
            rt = runtime()
            places = stream_places()
        keepalive = app.config.get("SSE_KEEPALIVE_SECONDS", KEEPALIVE_SECONDS)
        cancel = partial(cancel_run, rt)
        hub = StreamHub(
            rt.runs,
            rt.feed,
            places,
            keepalive,
            live_text=rt.live_text,
            cancel=cancel,
            follows_on=follows_on(rt),
        )
        app.extensions["tracon_stream_hub"] = (os.getpid(), hub)
        return hub
