"""Run one tool attempt under the execution's signal and its own timeout.

A sync handler that times out cannot be killed: the attempt is abandoned and its late
result is never consumed (the future is simply dropped). An `async def` handler runs on
the process's event loop thread and is really cancelled.

Every failed attempt is logged once, here: a `ToolError` the tool raised on purpose, a
timeout or an invalid argument at WARNING with no traceback, an unexpected exception at
ERROR with its traceback, a cancellation at INFO. The handler runs with the run's log
context (`logs.carry`), so its own lines carry the run id too.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from types import TracebackType
from typing import Any

from tracon_jobs import logs
from tracon_jobs.abort import AbortSignal
from tracon_jobs.agents.tools import ToolContext, ToolSpec
from tracon_jobs.errors import ToolCanceledError, ToolError, ToolTimeoutError
from tracon_jobs.providers.loop import get_loop

log = logging.getLogger(__name__)

_sync_pool = concurrent.futures.ThreadPoolExecutor(max_workers=64, thread_name_prefix="tool")


def run_attempt(spec: ToolSpec, arguments: dict[str, Any], context: ToolContext) -> Any:
    """The handler's result, or a ToolError (TIMEOUT, CANCELLED, or what it raised)."""
    try:
        return _run_attempt(spec, arguments, context)
    except ToolError as error:
        log_failed_attempt(spec, context, error)
        raise


def _run_attempt(spec: ToolSpec, arguments: dict[str, Any], context: ToolContext) -> Any:
    signal = context.signal
    future = _submit(spec, arguments, context)
    done = threading.Event()
    future.add_done_callback(lambda _f: done.set())
    unregister = signal.on_abort(lambda _reason: done.set())
    try:
        done.wait()
    finally:
        unregister()
    if signal.aborted:  # whatever the handler returns after the abort is not consumed
        future.cancel()
        raise _abort_error(spec, signal)
    return _result(spec, future)


def _submit(
    spec: ToolSpec, arguments: dict[str, Any], context: ToolContext
) -> concurrent.futures.Future[Any]:
    kwargs = dict(arguments)
    if spec.wants_context:
        kwargs["context"] = context
    if spec.is_async:
        coroutine = logs.carry_coroutine(spec.handler(**kwargs))
        return asyncio.run_coroutine_threadsafe(coroutine, get_loop())
    return _sync_pool.submit(logs.carry(spec.handler), **kwargs)


def _abort_error(spec: ToolSpec, signal: AbortSignal) -> ToolError:
    if signal.reason == "timeout":
        return ToolTimeoutError(f"tool '{spec.name}' timed out after {spec.timeout_ms} ms")
    return ToolCanceledError(f"tool '{spec.name}' was cancelled ({signal.reason})")


def _result(spec: ToolSpec, future: concurrent.futures.Future[Any]) -> Any:
    try:
        return future.result()
    except ToolError:
        raise
    except (concurrent.futures.CancelledError, asyncio.CancelledError) as exc:
        raise ToolCanceledError(f"tool '{spec.name}' was cancelled") from exc
    except TypeError as exc:
        raise ToolError(
            f"tool '{spec.name}' rejected its arguments: {exc}", code="INVALID_ARGUMENTS"
        ) from exc
    except Exception as exc:
        raise ToolError(f"{type(exc).__name__}: {exc}") from exc


def log_failed_attempt(spec: ToolSpec, context: ToolContext, error: ToolError) -> None:
    """One line per failed attempt; the traceback only when the tool did not mean to fail."""
    where = (
        f"tool '{spec.name}' attempt {context.attempt} failed "
        f"(run {context.run_id}, execution {context.execution_id})"
    )
    if isinstance(error, ToolCanceledError):
        log.info("%s: %s", where, error)
        return
    unexpected = _unexpected_cause(spec, error)
    if unexpected is None:
        log.warning("%s: [%s] %s", where, error.code, error)
        return
    exc_info: tuple[type[BaseException], BaseException, TracebackType | None] = (
        type(unexpected),
        unexpected,
        unexpected.__traceback__,
    )
    log.error("%s: [%s] %s", where, error.code, error, exc_info=exc_info)


def _unexpected_cause(spec: ToolSpec, error: ToolError) -> BaseException | None:
    """The exception a handler raised by accident (wrapped into `error`), if any.

    A `TypeError` counts only when it came from inside the handler: one raised while
    binding the model's arguments is the model's mistake, not the tool's.
    """
    cause = error.__cause__
    if cause is None or isinstance(cause, ToolError | asyncio.CancelledError):
        return None
    if isinstance(cause, concurrent.futures.CancelledError):
        return None
    if isinstance(cause, TypeError) and not _raised_inside(spec, cause):
        return None
    return cause


def _raised_inside(spec: ToolSpec, exc: BaseException) -> bool:
    code = getattr(getattr(spec.handler, "__wrapped__", spec.handler), "__code__", None)
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code is code:
            return True
        tb = tb.tb_next
    return False
