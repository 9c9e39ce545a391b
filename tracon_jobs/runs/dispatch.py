"""Submitting runs: the row first (with its enqueue time), then the message.

A crash between the row and the message leaves a `Queued` run that the requeue scan sends
after `Runs.RequeueAfter`; a broker that refuses the message closes the run `Failed`
(`enqueue_failed`) and the caller gets a 503, so nothing accepted is silently lost. A send
that took longer than `Runs.RequeueAfter` to fail (a broker cut off by a partition) may find
the run already sent again by the requeue scan and claimed by a worker: the run was accepted
after all, and the submission answers as if the send had succeeded, never a 503 for a run
that executes (a client retrying it would run it twice).

How a message is sent is the `Sender` the dispatcher is given: the Celery one is
`tracon_jobs.worker.envelope.celery_sender`; tests send runs to threads of their own.

With a `FairShare`, a run is offered to the fair lines first (`coordination.fair_share`):
sent now, or kept in its tenant's line until its turn; a fair store that cannot be reached
lets the run be sent at once (logged).

A traced submission is a span (`submission`): its context is the run's `traceparent`,
written on the row and carried by the message, the parent of every execution's span.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import redis

from tracon_jobs import metrics, tracing
from tracon_jobs.coordination.fair_share import DEFAULT_PRIORITY, FairStore, Offered, fair_ids
from tracon_jobs.coordination.scripts import Later
from tracon_jobs.db.models import Run
from tracon_jobs.errors import EnqueueError
from tracon_jobs.runs.lifecycle import ErrorClass, RunError
from tracon_jobs.runs.store import NewRun, RunStore

log = logging.getLogger(__name__)

Sender = Callable[[str], None]
"""`send(run_id)`: the run's message; raises `EnqueueError` when the broker refuses it."""


Message = Callable[[str], str]
"""`message(run_id)`: the run's message as the fair store pushes it itself (the envelope)."""


@dataclass(frozen=True)
class FairShare:
    """The fair lines, and (with the envelope fast path) how a run's message is built."""

    store: FairStore
    message: Message | None = None


class RunDispatcher:
    """Submits runs: the row first, then the message; a refused message fails the run."""

    def __init__(self, store: RunStore, send: Sender, fair: FairShare | None = None) -> None:
        self.store = store
        self.send = send
        self.fair = fair
        self._submitting: dict[str, tuple[str, str]] = {}  # run id -> (agent, tenant id)

    def submitting(self, run_id: str) -> tuple[str, str] | None:
        """(agent, tenant id) of a run this process is sending right now: what its message
        is labelled with, without reading the row back."""
        return self._submitting.get(run_id)

    def submit(self, new: NewRun) -> Run:
        with submission(new) as traced:
            run = self.store.create(traced)
            try:
                self.offer_run(run)
            except EnqueueError as exc:
                error = RunError("enqueue_failed", ErrorClass.INFRASTRUCTURE, str(exc))
                if self.store.fail_unsent(run.id, error):
                    log.error("enqueue failed for run %s: %s", run.id, exc)
                    raise
                # no longer Queued: the requeue scan sent it meanwhile and a worker has it
                log.warning("run %s was re-sent and taken while its send failed: %s", run.id, exc)
            return run

    def resend(self, run_id: str, *, lost: bool = False) -> bool:
        """Send a run's message again (a run in its tenant's line stays there); False
        (logged) when the broker refused. `lost`: its message is known lost (the worker
        that held it died): sent at once, past the lines, where its place is still taken
        by the lost delivery until a worker takes this one."""
        try:
            if self.fair is None or lost:
                self.send(run_id)
            else:
                run = self.store.get(run_id)
                if run is None:
                    return False
                if self.offer_run(run) is Offered.ALREADY:
                    # On its way, by the lines, for as long as the message has been unclaimed
                    # by SQL's clock (the lines count from the send, a moment after the row
                    # was written, and may not have let go of it yet): lost, sent now.
                    self.send(run_id)
        except EnqueueError as exc:
            log.warning("re-send of run %s failed, next scan retries: %s", run_id, exc)
            return False
        self.store.mark_enqueued(run_id)
        return True

    def offer_run(self, run: Run) -> Offered:
        """`offer` of a run whose row is in hand (a submission, a continuation, a schedule's
        fire): its message is labelled from it (`submitting`), not from a read of the row."""
        self._submitting[run.id] = (run.agent, run.tenant_id)
        try:
            return self.offer(run.id, run.tenant_id, run.priority)
        finally:
            self._submitting.pop(run.id, None)

    def offer(self, run_id: str, tenant_id: str, priority: int = DEFAULT_PRIORITY) -> Offered:
        """Send the run now, or line it up: through the fair lines when there are some; what
        became of it (`SENT` when no lines were asked)."""
        if self.fair is None:
            self.send(run_id)
            return Offered.SENT
        message = None
        if self.fair.message is not None:
            try:
                message = self.fair.message(run_id)
            except Exception as exc:  # kombu and Celery raise many types
                raise EnqueueError(f"the message of run {run_id} was not built: {exc}") from exc
        try:
            offer = self.fair.store.offer(run_id, tenant_id, priority, message)
        except redis.RedisError as exc:
            log.warning("fair lines unreachable; run %s is sent at once: %s", run_id, exc)
            self.send(run_id)
            return Offered.SENT
        if message is not None and offer.outcome in (Offered.SENT, Offered.LINED):
            metrics.message_sent(ok=True)  # pushed now, or kept to be pushed in its turn
        self.send_all(offer.to_send, first=run_id)
        return offer.outcome

    def taken(self, run_id: str) -> None:
        """A worker claimed the run: it is running now, its place still taken (a run still
        in its line, claimed from a stale message, leaves it)."""
        if self.fair is None:
            return
        try:
            self.send_all(self.fair.store.take(run_id))
        except redis.RedisError as exc:  # its place frees itself after Runs.RequeueAfter
            log.warning("fair lines not told of run %s: %s", run_id, exc)

    def done(self, run_id: str) -> None:
        """The run holds no place any more (it ended or was dropped on a worker, or was
        canceled in its tenant's line): the runs it makes room for are sent."""
        if self.fair is None:
            return
        try:
            self.send_all(self.fair.store.done(run_id))
        except redis.RedisError as exc:  # its place frees itself once no worker names it
            log.warning("fair lines not told that run %s is done: %s", run_id, exc)

    def done_later(self, run_id: str) -> Later | None:
        """`done`, sent with this thread's next Redis call on the store's client (the run's
        final publish, inside `deferring`); None when it cannot be: the caller calls `done`."""
        if self.fair is None:
            return None
        return self.fair.store.done_later(run_id)

    def taken_later(self, run_id: str) -> Later | None:
        """`taken`, sent with this thread's next Redis call on the store's client (inside
        `deferring`); at once (None) when the caller must send the runs handed over now."""
        if self.fair is None:
            return None
        later = self.fair.store.take_later(run_id)
        if later is None:
            self.taken(run_id)
        return later

    def send_handed_over(self, taken: Later) -> None:
        """Send the runs a `taken_later` handed over (none when the store pushed them)."""
        try:
            handed = taken.reply()
        except redis.RedisError as exc:  # its place frees itself after Runs.RequeueAfter
            log.warning("fair lines not told of a claim: %s", exc)
            return
        self.send_all(fair_ids(handed))

    def send_all(self, run_ids: list[str], first: str | None = None) -> None:
        """Send the runs the fair lines handed over (`first`, the caller's own run, raises
        when refused; another run refused is logged, and the requeue scan sends it)."""
        for run_id in run_ids:
            if run_id == first:
                self.send(run_id)
                continue
            try:
                self.send(run_id)
            except EnqueueError as exc:
                log.warning("run %s not sent from its line, next scan retries: %s", run_id, exc)


@contextlib.contextmanager
def submission(new: NewRun) -> Iterator[NewRun]:
    """The run's submission span around writing its row and sending it: `new` with the
    span's traceparent (unchanged when untraced). A run that continues another one joins
    that run's trace and links to it (and to the request that asked for it, if any)."""
    if not tracing.on():
        yield new
        return
    links: list[str | None] = [] if new.continues_trace is None else [new.continues_trace]
    if new.continues_trace is not None:
        links.append(tracing.current_traceparent())
    attributes = {
        "tracon.run.id": new.id,
        "tracon.run.kind": new.kind,
        "tracon.run.attempt": new.attempt,
        "tracon.run.priority": new.priority,
        "tracon.run.parent_id": new.parent_run_id,
        "tracon.run.continued_from": new.continued_from_run_id,
        "tracon.tenant.id": new.tenant_id,
        "gen_ai.agent.name": new.agent if new.kind == "agent" else None,
    }
    with tracing.span(
        f"submit {new.agent}",
        kind=tracing.PRODUCER,
        attributes=attributes,
        parent=new.continues_trace,
        links=links,
    ) as span:
        traceparent = span.traceparent
        yield new if traceparent is None else dataclasses.replace(new, traceparent=traceparent)
