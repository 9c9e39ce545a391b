"""Money as the console writes it: one format on every page (runs list, run page, timeline,
statistics and their plots), so one amount always reads the same, never in scientific
notation, with the digits a tiny model call's cost needs."""

from __future__ import annotations

from decimal import Decimal

SIGNIFICANT = 3
"""Significant digits of an amount below 1: 0.000053, 0.0123, 0.50."""


def money(amount: float | Decimal | None) -> str:
    """`amount` with two decimals from 1 up (thousands grouped: 1,234.50); below 1, its
    first three significant digits, trailing zeros dropped down to two decimals
    (0.000053, 0.0001, 0.50); nothing at all is 0.00."""
    value = Decimal(str(amount or 0))
    if value == 0:
        return "0.00"
    if abs(value) >= 1:
        return f"{value:,.2f}"
    places = max(2, SIGNIFICANT - 1 - value.adjusted())  # adjusted: the first digit's power
    whole, _, fraction = f"{value:.{places}f}".partition(".")
    return f"{whole}.{fraction.rstrip('0').ljust(2, '0')}"
