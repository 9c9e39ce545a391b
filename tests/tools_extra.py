"""More tools the tests register (imported through `ToolModules` as "tests.tools_extra").

They record what they did in module lists, keyed by run, so a test reads only its own runs'
entries whatever else ran in the process.
"""

from __future__ import annotations

import threading
import time

from tracon_jobs import ToolContext, tool

_lock = threading.Lock()

writes: list[tuple[str, str, str]] = []
"""(tool, run id, idempotency key) of each body of `repeatable_write`/`unrepeatable_write`."""


def _write(name: str, context: ToolContext) -> None:
    with _lock:
        writes.append((name, context.run_id, context.idempotency_key))


@tool(side_effect="write", safe_to_repeat=True)
def repeatable_write(step: str, *, context: ToolContext) -> str:
    """A write whose repeat is harmless (it deduplicates on its idempotency key)."""
    _write("repeatable_write", context)
    return f"wrote {step}"


@tool(side_effect="write")
def unrepeatable_write(step: str, *, context: ToolContext) -> str:
    """The same write, without the claim that repeating it is safe."""
    _write("unrepeatable_write", context)
    return f"wrote {step}"


timings: list[tuple[str, str, float, float]] = []
"""(run id, label, start, end) of each `timed_sleep`, on the monotonic clock."""


@tool(side_effect="none", timeout_ms=10_000)
def timed_sleep(label: str, seconds: float, *, context: ToolContext) -> str:
    """Wait `seconds` (ending early on a cancel), recording when it started and ended."""
    started = time.monotonic()
    context.signal.wait(seconds)
    ended = time.monotonic()
    with _lock:
        timings.append((context.run_id, label, started, ended))
    return f"{label} slept"
