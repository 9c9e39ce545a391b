"""A worker's hooks that keep its held runs' record (`coordination.held`): a run's message is
held from the moment Celery hands it to the worker until its task ends, or is revoked."""

from __future__ import annotations

from typing import Any

from celery import Celery
from celery.signals import task_postrun, task_received, task_revoked, worker_ready, worker_shutdown

from tracon_jobs.coordination.held import HeldRuns
from tracon_jobs.worker.envelope import EXECUTE_TASK


def follow_held_runs(app: Celery, held: HeldRuns) -> None:
    """Connect `held` to this app's worker (in any other process nothing fires)."""

    def ours(sender: Any) -> bool:
        return getattr(sender, "app", None) is app

    def on_ready(sender: Any = None, **_kwargs: Any) -> None:
        if ours(sender):
            held.start()

    def on_received(sender: Any = None, request: Any = None, **_kwargs: Any) -> None:
        run_id = _run_of(request)
        if ours(sender) and run_id is not None:
            held.took(run_id)

    def on_ended(sender: Any = None, args: Any = None, kwargs: Any = None, **_kwargs: Any) -> None:
        if ours(sender) and getattr(sender, "name", None) == EXECUTE_TASK:
            run_id = _argument(args, kwargs)
            if run_id is not None:
                held.let_go(run_id)

    def on_revoked(sender: Any = None, request: Any = None, **_kwargs: Any) -> None:
        run_id = _run_of(request)
        if ours(sender) and run_id is not None:
            held.let_go(run_id)

    def on_shutdown(sender: Any = None, **_kwargs: Any) -> None:
        if ours(sender):
            held.stop()

    worker_ready.connect(on_ready, weak=False)
    task_received.connect(on_received, weak=False)
    task_postrun.connect(on_ended, weak=False)
    task_revoked.connect(on_revoked, weak=False)
    worker_shutdown.connect(on_shutdown, weak=False)


def _run_of(request: Any) -> str | None:
    """The run a request of `tracon.runs.execute` executes."""
    if getattr(request, "name", None) != EXECUTE_TASK:
        return None
    return _argument(getattr(request, "args", None), getattr(request, "kwargs", None))


def _argument(args: Any, kwargs: Any) -> str | None:
    """`run_id`, given by name (`celery_sender`) or, in an older message, first."""
    if isinstance(kwargs, dict) and kwargs.get("run_id"):
        return str(kwargs["run_id"])
    return str(args[0]) if args else None
