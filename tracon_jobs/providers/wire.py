"""What the HTTP providers share: their errors, `Retry-After`, and reading an answer's JSON
leniently (a server that sends a field of the wrong type is read, not crashed on)."""

from __future__ import annotations

import email.utils
import json
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from tracon_jobs.abort import AbortSignal
from tracon_jobs.errors import ProviderError


def cancelled(provider: str, signal: AbortSignal) -> ProviderError:
    return ProviderError(
        f"Call to provider '{provider}' cancelled ({signal.reason or 'cancelled'})",
        provider=provider,
        kind="cancelled",
    )


def malformed(provider: str, what: str) -> ProviderError:
    """An answer that is not what the API promises: the provider's fault (`kind="connection"`:
    the call may be tried again or fall back), never a crash of the run."""
    return ProviderError(
        f"Provider '{provider}' returned {what}", provider=provider, kind="connection"
    )


def parse_retry_after(headers: Mapping[str, str], now: datetime | None = None) -> float | None:
    """Seconds to wait from `retry-after-ms`, or `Retry-After` as seconds or an HTTP date."""
    lowered = {key.lower(): value for key, value in headers.items()}
    milliseconds = _float_or_none(lowered.get("retry-after-ms"))
    if milliseconds is not None:
        return max(milliseconds / 1000.0, 0.0)
    value = lowered.get("retry-after")
    if value is None:
        return None
    seconds = _float_or_none(value)
    if seconds is not None:
        return max(seconds, 0.0)
    return _seconds_until_http_date(value, now or datetime.now(UTC))


def _seconds_until_http_date(value: str, now: datetime) -> float | None:
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return max((when - now).total_seconds(), 0.0)


def _float_or_none(value: str | None) -> float | None:
    if value is None:
        return None
    try:
        return float(value)
    except ValueError:
        return None


def describe(exc: BaseException) -> str:
    """The SDK's message plus its cause, which says what actually went wrong on the wire."""
    cause = exc.__cause__
    if cause is None or str(cause) in str(exc):
        return str(exc)
    return f"{exc} ({type(cause).__name__}: {cause})"


def json_object(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def text(value: Any) -> str:
    if value is None or isinstance(value, str):
        return value or ""
    return json.dumps(value)  # a server that sent structured content: kept, as JSON


def count(value: Any) -> int:
    return value if isinstance(value, int) and value > 0 else 0
