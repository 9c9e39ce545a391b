"""How the commands and the console write numbers: an amount of money with the digits it
has, up to the eight places a cost is kept with (`0.000053 USD`, never `0.0000 USD` nor
`5.3e-05`), and JSON whose numbers are written the same way, positional, so a reader sees a
tiny cost as it is."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from decimal import ROUND_HALF_EVEN, Context, Decimal
from typing import Any

COST_PLACES = 8
"""The decimal places a cost is kept with (`runs.cost_amount` is NUMERIC(18, 8)): the most an
amount is printed with."""

LEAST_PLACES = 2
"""An amount keeps two places however round it is (`0.00`, `1.50`), as money is written."""


def cost_text(amount: Decimal | float | int, currency: str) -> str:
    """`0.000053 USD`: the one way every command prints a cost, a spend or a limit."""
    return f"{amount_text(amount)} {currency}"


def amount_text(amount: Decimal | float | int) -> str:
    """`amount` rounded to `COST_PLACES`, positional, trailing zeros dropped down to
    `LEAST_PLACES`: `0.00`, `1.50`, `0.000053`, `100000.00` (for `1E+5`)."""
    exact = _decimal(amount)
    digits = max(exact.adjusted() + 2, 1) + COST_PLACES  # the whole part, and a carry (9.999…)
    rounded = exact.quantize(Decimal(1).scaleb(-COST_PLACES), ROUND_HALF_EVEN, Context(prec=digits))
    if rounded.is_zero():
        rounded = rounded.copy_abs()  # a cost rounded to nothing is 0.00, not -0.00
    whole, _, places = positional(rounded).partition(".")
    return f"{whole}.{places.rstrip('0').ljust(LEAST_PLACES, '0')}"


def positional(number: Decimal) -> str:
    """`number` in positional notation with exactly its digits (`Decimal('5.3E-5')`:
    `0.000053`), never an exponent."""
    return f"{number:f}"


def _decimal(number: Decimal | float | int) -> Decimal:
    """A float's shortest digits (`repr`), not its binary expansion (`0.1` stays `0.1`)."""
    return number if isinstance(number, Decimal) else Decimal(repr(number))


def json_text(document: Any, *, indent: int | None = 2, ensure_ascii: bool = True) -> str:
    """`json.dumps(document, indent=indent, ensure_ascii=ensure_ascii, default=str)` (compact
    separators when `indent` is None), except that a finite float is written positional with
    its shortest digits: `0.0000339`, not `3.39e-05`. Still JSON: a reader parses the same
    floats back."""
    return "".join(_json_parts(document, indent, 0, ensure_ascii))


def _json_parts(value: Any, indent: int | None, depth: int, ascii: bool) -> Iterator[str]:
    if isinstance(value, float) and math.isfinite(value):
        text = positional(_decimal(value))
        yield text if "." in text else text + ".0"  # `1e16` stays a float: 10000000000000000.0
    elif isinstance(value, dict) and value:
        yield "{"
        for index, (key, item) in enumerate(value.items()):
            yield ("," if index else "") + _break(indent, depth + 1)
            yield json.dumps(str(key), ensure_ascii=ascii) + ":"
            yield "" if indent is None else " "
            yield from _json_parts(item, indent, depth + 1, ascii)
        yield _break(indent, depth) + "}"
    elif isinstance(value, list | tuple) and value:
        yield "["
        for index, item in enumerate(value):
            yield ("," if index else "") + _break(indent, depth + 1)
            yield from _json_parts(item, indent, depth + 1, ascii)
        yield _break(indent, depth) + "]"
    else:
        yield json.dumps(value, ensure_ascii=ascii, default=str)


def _break(indent: int | None, depth: int) -> str:
    return "" if indent is None else "\n" + " " * (indent * depth)
