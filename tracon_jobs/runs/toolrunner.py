"""Run one tool attempt under the execution's signal and its own timeout.

A sync handler that times out cannot be killed: the attempt is abandoned and its late
result is never consumed (the future is simply dropped). An `async def` handler runs on
the process's event loop thread and is really cancelled.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Any

from tracon_jobs.abort import AbortSignal
from tracon_jobs.agents.tools import ToolContext, ToolSpec
from tracon_jobs.errors import ToolCanceledError, ToolError, ToolTimeoutError
from tracon_jobs.providers.loop import get_loop

_sync_pool = concurrent.futures.ThreadPoolExecutor(max_workers=64, thread_name_prefix="tool")


def run_attempt(spec: ToolSpec, arguments: dict[str, Any], context: ToolContext) -> Any:
    """The handler's result, or a ToolError (TIMEOUT, CANCELLED, or what it raised)."""
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
        return asyncio.run_coroutine_threadsafe(spec.handler(**kwargs), get_loop())
    return _sync_pool.submit(spec.handler, **kwargs)


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
