"""Token pricing at the model the answering link asked for.

Providers answer an alias with a dated name (`gpt-4o-mini` -> `gpt-4o-mini-2024-07-18`), so
the price is looked up under the model the link was configured with first, then under the
name the provider answered with, then under that name without a dated suffix.
"""

from __future__ import annotations

import re
from decimal import Decimal
from typing import Protocol

from tracon_jobs.providers.base import Usage

MILLION = Decimal(1_000_000)


class Price(Protocol):
    @property
    def input_per_million(self) -> Decimal: ...

    @property
    def output_per_million(self) -> Decimal: ...

    @property
    def cached_input_per_million(self) -> Decimal | None: ...

    @property
    def cache_write_per_million(self) -> Decimal | None: ...


class _Pricing(Protocol):
    @property
    def currency(self) -> str: ...

    def price_for(self, model: str) -> Price | None: ...


def price(pricing: _Pricing, model: str, usage: Usage) -> tuple[Decimal, str]:
    """(amount, source): source is `Configured`, or `Unknown` with amount 0 when unpriced."""
    rate = pricing.price_for(model)
    if rate is None:
        return Decimal(0), "Unknown"
    full_rate = rate.input_per_million
    cached = usage.cached_input_tokens
    written = usage.cache_write_input_tokens
    uncached = max(usage.input_tokens - cached - written, 0)
    amount = (
        Decimal(uncached) * full_rate
        + Decimal(cached) * _or(rate.cached_input_per_million, full_rate)
        + Decimal(written) * _or(rate.cache_write_per_million, full_rate)
        + Decimal(usage.output_tokens) * rate.output_per_million
    ) / MILLION
    return amount, "Configured"


def _or(rate: Decimal | None, otherwise: Decimal) -> Decimal:
    return otherwise if rate is None else rate


_DATED = re.compile(r"-(\d{4}-\d{2}-\d{2}|\d{8}|\d{4})$")


def price_at(pricing: _Pricing, asked: str, answered: str, usage: Usage) -> tuple[Decimal, str]:
    """`price` at the first of: the model asked for, the model that answered, the answered
    name without its dated suffix (`-2024-07-18`, `-20240718`, `-0613`)."""
    for model in (asked, answered, _DATED.sub("", answered)):
        if pricing.price_for(model) is not None:
            return price(pricing, model, usage)
    return Decimal(0), "Unknown"


def price_before(pricing: _Pricing, asked: str) -> Price | None:
    """The price a call to model `asked` will be charged at, as far as it is known before
    the call (the model that answers may name itself otherwise): `asked`, then `asked`
    without a dated suffix."""
    return pricing.price_for(asked) or pricing.price_for(_DATED.sub("", asked))
