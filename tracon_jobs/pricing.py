"""Token pricing at the model that actually answered."""

from __future__ import annotations

from decimal import Decimal
from typing import Protocol

from tracon_jobs.providers.base import Usage

MILLION = Decimal(1_000_000)


class _Price(Protocol):
    @property
    def input_per_million(self) -> Decimal: ...

    @property
    def output_per_million(self) -> Decimal: ...


class _Pricing(Protocol):
    @property
    def currency(self) -> str: ...

    def price_for(self, model: str) -> _Price | None: ...


def price(pricing: _Pricing, model: str, usage: Usage) -> tuple[Decimal, str]:
    """(amount, source): source is `Configured`, or `Unknown` with amount 0 when unpriced."""
    rate = pricing.price_for(model)
    if rate is None:
        return Decimal(0), "Unknown"
    amount = (
        Decimal(usage.input_tokens) * rate.input_per_million
        + Decimal(usage.output_tokens) * rate.output_per_million
    ) / MILLION
    return amount, "Configured"
