"""Demo tools, registered when `ToolModules` names this module."""

from __future__ import annotations

from tracon_jobs import ToolContext, tool

ORDERS = {"A-1001": {"status": "shipped", "carrier": "DHL", "eta": "tomorrow"}}


@tool(side_effect="read", retry={"max_attempts": 2}, timeout_ms=5_000)
def lookup_order(order_id: str, *, context: ToolContext) -> dict[str, str]:
    """Look up an order's shipping status by its id."""
    return ORDERS.get(order_id, {"status": "unknown"}) | {"order_id": order_id}
