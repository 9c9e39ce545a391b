"""Tools the tests register (imported through `ToolModules`)."""

from __future__ import annotations

import threading
import time

from tracon_jobs import ToolContext, tool

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
