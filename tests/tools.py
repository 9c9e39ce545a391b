"""Tools the tests register (imported through `ToolModules`)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from tracon_jobs import ToolContext, tool
from tracon_jobs.errors import RetryableToolError

calls: list[tuple[str, dict[str, object]]] = []
_lock = threading.Lock()


def record(name: str, **arguments: object) -> None:
    with _lock:
        calls.append((name, arguments))


@tool(side_effect="read")
def lookup_order(order_id: str, *, context: ToolContext) -> dict[str, str]:
    """Look up an order."""
    record("lookup_order", order_id=order_id, key=context.idempotency_key)
    return {"order_id": order_id, "status": "shipped"}


@tool(side_effect="none", timeout_ms=300)
def slow_tool(seconds: float) -> str:
    """Sleep, ignoring cancellation (a sync tool that cannot be killed)."""
    time.sleep(seconds)
    return "late"


@tool(side_effect="write")
def failing_tool(reason: str) -> str:
    """Always fails."""
    raise ValueError(reason)


@tool(side_effect="none")
async def async_echo(text: str) -> str:
    """Echo, asynchronously."""
    return text.upper()


charges: list[int] = []


@tool(side_effect="external")
def charge_card(amount_cents: int, *, context: ToolContext) -> dict[str, object]:
    """Charge a card: an effect outside the process that must never run twice."""
    with _lock:
        charges.append(amount_cents)
    return {"charged": amount_cents, "key": context.idempotency_key}


def _flag(name: str) -> Path | None:
    directory = os.environ.get("TRACON_TEST_FLAGS")
    return Path(directory) / name if directory else None


def _append(name: str, line: str) -> None:
    """An external counter that survives the worker process (a file per tool)."""
    path = _flag(f"{name}.log")
    if path is not None:
        with path.open("a") as handle:
            handle.write(line + "\n")


@tool(side_effect="write", safe_to_repeat=False)
def record_step(step: str, *, context: ToolContext) -> str:
    """Write a step to the outside world (counted in a file)."""
    _append("record_step", f"{step} {context.idempotency_key}")
    record("record_step", step=step)
    return f"recorded {step}"


@tool(side_effect="read", timeout_ms=120_000)
def slow_step(seconds: float, *, context: ToolContext) -> str:
    """Wait, unless the `fast` flag exists; observes cancellation."""
    _append("slow_step", context.idempotency_key)
    fast = _flag("fast")
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not (fast and fast.exists()):
        if context.signal.wait(0.05):
            return "cancelled"
    return "slow done"


@tool(side_effect="destructive", timeout_ms=120_000)
def wipe_records(seconds: float, *, context: ToolContext) -> str:
    """A destructive tool that takes its time."""
    _append("wipe_records", context.idempotency_key)
    context.signal.wait(seconds)
    return "wiped"


flaky_attempts: dict[str, list[str]] = {}


@tool(side_effect="read", retry={"max_attempts": 2, "backoff_ms": 10})
def flaky_read(key: str, *, context: ToolContext) -> str:
    """Fails once per key (retryable), then answers."""
    with _lock:
        seen = flaky_attempts.setdefault(key, [])
        seen.append(context.idempotency_key)
        first = len(seen) == 1
    if first:
        raise RetryableToolError("the upstream hiccupped")
    return f"value of {key}"


@tool(side_effect="external")
def render_audio(seconds: float, *, context: ToolContext) -> str:
    """A paid tool: reports what it spent beyond tokens."""
    context.report_usage(0.05, "USD")
    context.report_usage(1.0, "EUR")  # another currency: unknown to the budget
    return "rendered"


@tool(side_effect="destructive", requires_approval=True)
def close_account(account: str, *, context: ToolContext) -> str:
    """Close an account: a person approves every call (counted in a file)."""
    _append("close_account", f"{account} {context.execution_id}")
    record("close_account", account=account)
    return f"closed {account}"


refund_attempts: list[str] = []


@tool(
    side_effect="write",
    idempotent=True,
    requires_approval=True,
    retry={"max_attempts": 2, "backoff_ms": 1},
)
def approved_refund(order: str, *, context: ToolContext) -> str:
    """Refund once approved; the first attempt of each execution fails (a retry follows)."""
    with _lock:
        refund_attempts.append(context.execution_id)
        first = refund_attempts.count(context.execution_id) == 1
    if first:
        raise RetryableToolError("payment service busy")
    return f"refunded {order}"


@tool(side_effect="destructive", requires_approval=True, timeout_ms=120_000)
def slow_gated_wipe(seconds: float, *, context: ToolContext) -> str:
    """A gated destructive tool that takes its time once approved (counted in a file)."""
    _append("slow_gated_wipe", context.execution_id)
    context.signal.wait(seconds)
    return "wiped"
