"""How the commands write amounts and JSON: tiny costs keep their digits and never turn into
an exponent; the JSON is the same document `json.dumps` writes, laid out the same way."""

from __future__ import annotations

import json
from decimal import Decimal
from typing import Any

import pytest

from tracon_jobs.numbers import amount_text, cost_text, json_text


@pytest.mark.parametrize(
    ("amount", "text"),
    [
        (0.000053, "0.000053"),  # before: 0.0000 in `runs list`, 5.3e-05 in `runs show`
        (Decimal("0.00005300"), "0.000053"),
        (3.39e-05, "0.0000339"),
        (Decimal("0.00000001"), "0.00000001"),  # the smallest cost a run keeps
        (0.123456789, "0.12345679"),  # eight places at most, as the runs table keeps them
        (Decimal("9.999999999"), "10.00"),  # rounding carries into the whole part
        (Decimal("99999.999999999"), "100000.00"),
        (0, "0.00"),
        (Decimal("-1E-9"), "0.00"),  # not -0.00
        (1.5, "1.50"),
        (5, "5.00"),
        (12345.67891234, "12345.67891234"),
        (Decimal("1E+5"), "100000.00"),  # a `--cost-limit 1e5` is no `1E+5 USD`
        (Decimal("1E+30"), "1000000000000000000000000000000.00"),
    ],
)
def test_an_amount_keeps_its_digits_in_positional_notation(
    amount: Decimal | float, text: str
) -> None:
    assert amount_text(amount) == text


def test_a_cost_is_its_amount_and_currency() -> None:
    assert cost_text(0.000053, "USD") == "0.000053 USD"


DOCUMENT: dict[str, Any] = {
    "cost": {"amount": 5.3e-05, "currency": "USD"},
    "events": [{"seq": 1, "data": {"big": 1e16, "none": None, "list": []}}, {}],
    "text": 'naïve "quoted"',
    "flag": True,
    "half": 0.5,
}


def test_json_writes_tiny_and_huge_floats_positional_and_parses_back_the_same() -> None:
    pretty = json_text(DOCUMENT)
    compact = json_text(DOCUMENT, indent=None)

    for text in (pretty, compact):
        assert json.loads(text) == DOCUMENT
        assert "e-05" not in text and "e+16" not in text
        assert "0.000053" in text and "10000000000000000.0" in text


def test_json_is_laid_out_as_json_dumps_lays_it_out() -> None:
    plain = {key: value for key, value in DOCUMENT.items() if key not in ("cost", "events")}
    plain["nested"] = {"a": [1, {"b": "c"}], "empty": {}}

    assert json_text(plain) == json.dumps(plain, indent=2)
    assert json_text(plain, indent=None) == json.dumps(plain, separators=(",", ":"))
