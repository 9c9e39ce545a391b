"""The console's one money format: never scientific notation, the digits a tiny cost needs,
and the same text for one amount whatever type it arrives as (SQL's Decimal, a float)."""

from __future__ import annotations

import json
from decimal import Decimal

import pytest

from web.console.blueprint import pretty
from web.console.money import money


@pytest.mark.parametrize(
    ("amount", "text"),
    [
        (None, "0.00"),
        (0, "0.00"),
        (5.3e-05, "0.000053"),
        (Decimal("0.00005300"), "0.000053"),  # a run's cost_amount, Numeric(18, 8)
        (0.0001, "0.0001"),
        (0.00012345, "0.000123"),
        (1e-09, "0.000000001"),
        (0.0123456, "0.0123"),
        (0.5, "0.50"),
        (0.999, "0.999"),
        (0.9996, "1.00"),
        (1.2345, "1.23"),
        (1234.5, "1,234.50"),
        (-5.3e-05, "-0.000053"),
    ],
)
def test_money_reads_plainly(amount: float | Decimal | None, text: str) -> None:
    assert money(amount) == text


def test_a_reported_amount_in_an_events_details_reads_as_on_the_rest_of_the_page() -> None:
    # a `UsageReported` event's data, drawn in the run page's timeline with `pretty`
    shown = pretty({"amount": 5.3e-05, "currency": "USD", "note": "café"})
    assert '"amount": 0.000053' in shown and "e-05" not in shown
    assert "café" in shown  # as written, not escaped
    assert json.loads(shown) == {"amount": 5.3e-05, "currency": "USD", "note": "café"}
