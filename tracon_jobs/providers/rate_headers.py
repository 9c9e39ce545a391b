"""What a provider's answer says of its own rate limits: OpenAI's `x-ratelimit-*` headers
and Anthropic's `anthropic-ratelimit-*`, read into the seconds until a spent limit resets
(`ModelResponse.provider_wait`; `resilience.rate_limits` keeps every worker's calls back
until then)."""

from __future__ import annotations

import re
import time
from collections.abc import Mapping
from datetime import datetime

_DURATION = re.compile(
    r"(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m(?!s))?(?:(\d+(?:\.\d+)?)s)?"
    r"(?:(\d+(?:\.\d+)?)ms)?"
)


def openai_reset_seconds(value: str) -> float | None:
    """OpenAI's `x-ratelimit-reset-*`: `1s`, `6m0s`, `20ms`, `1h2m3.5s`."""
    text = value.strip()
    found = _DURATION.fullmatch(text)
    if not text or found is None or not any(found.groups()):
        return None
    hours, minutes, seconds, millis = (float(part) if part else 0.0 for part in found.groups())
    return hours * 3600 + minutes * 60 + seconds + millis / 1000


def rfc3339_seconds(value: str, now: float | None = None) -> float | None:
    """Anthropic's `anthropic-ratelimit-*-reset`: a time (RFC 3339), as seconds from now."""
    try:
        at = datetime.fromisoformat(value.strip().replace("Z", "+00:00"))
    except ValueError:
        return None
    if at.tzinfo is None:
        return None
    return max(at.timestamp() - (time.time() if now is None else now), 0.0)


RATE_HEADERS = (
    # (remaining header, reset header, how the reset is written)
    ("x-ratelimit-remaining-requests", "x-ratelimit-reset-requests", openai_reset_seconds),
    ("x-ratelimit-remaining-tokens", "x-ratelimit-reset-tokens", openai_reset_seconds),
    (
        "anthropic-ratelimit-requests-remaining",
        "anthropic-ratelimit-requests-reset",
        rfc3339_seconds,
    ),
    ("anthropic-ratelimit-tokens-remaining", "anthropic-ratelimit-tokens-reset", rfc3339_seconds),
    (
        "anthropic-ratelimit-input-tokens-remaining",
        "anthropic-ratelimit-input-tokens-reset",
        rfc3339_seconds,
    ),
    (
        "anthropic-ratelimit-output-tokens-remaining",
        "anthropic-ratelimit-output-tokens-reset",
        rfc3339_seconds,
    ),
)


def exhausted_for(headers: Mapping[str, str]) -> float | None:
    """Seconds until the provider takes calls again, when an answer's headers say a limit
    has nothing left (the longest such reset); None when every limit has room."""
    lowered = {key.lower(): value for key, value in headers.items()}
    waits = []
    for remaining, reset, parse in RATE_HEADERS:
        left = lowered.get(remaining)
        when = lowered.get(reset)
        if left is None or when is None:
            continue
        try:
            empty = float(left) <= 0
        except ValueError:
            continue
        seconds = parse(when) if empty else None
        if seconds is not None:
            waits.append(seconds)
    return max(waits) if waits else None
