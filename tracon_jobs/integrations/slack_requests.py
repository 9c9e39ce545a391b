"""Slack's requests to us (`POST /integrations/slack/interactions`), and why we believe them.

Slack signs each request with the app's signing secret: `X-Slack-Signature` is `v0=` and the
hex HMAC-SHA256 of `v0:{X-Slack-Request-Timestamp}:{raw body}`. A request is refused unless

1. both headers are there, the timestamp a number of seconds;
2. the timestamp is within `TOLERANCE_SECONDS` of now, either way (an old request replayed,
   or one stamped ahead to live longer in a replay cache);
3. the signature matches, compared in constant time;
4. no request with the same signature came within the window: the first takes a lease named
   for its signature for the whole window (Redis `SET NX PX` in the Lua of `LeaseStore`), a
   copy finds it taken. Taken only after the signature matched, so that nobody without the
   secret can fill the store.

The signature is the only credential: these routes take no API key.
"""

from __future__ import annotations

import hashlib
import hmac
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from tracon_jobs.coordination.leases import LeaseStore

TOLERANCE_SECONDS: Final = 300
"""How far a request's timestamp may be from now (Slack's own advice: five minutes)."""

VERSION: Final = "v0"
TIMESTAMP_HEADER: Final = "X-Slack-Request-Timestamp"
SIGNATURE_HEADER: Final = "X-Slack-Signature"


class RequestRefused(Exception):
    """Not a request Slack signed for us now: the route answers 401 and decides nothing."""


def signature(secret: str, timestamp: str, body: bytes) -> str:
    """What Slack sends in `X-Slack-Signature` for this timestamp and body."""
    base = f"{VERSION}:{timestamp}:".encode() + body
    return f"{VERSION}=" + hmac.new(secret.encode(), base, hashlib.sha256).hexdigest()


def verify(
    secret: str,
    headers: Mapping[str, str],
    body: bytes,
    now: float,
    tolerance: int = TOLERANCE_SECONDS,
) -> str:
    """The request's signature once checked (rules 1 to 3 above); `RequestRefused` saying
    which rule it broke otherwise."""
    timestamp = headers.get(TIMESTAMP_HEADER, "")
    sent = headers.get(SIGNATURE_HEADER, "")
    if not timestamp or not sent:
        missing = TIMESTAMP_HEADER if not timestamp else SIGNATURE_HEADER
        raise RequestRefused(f"{missing}: the header is missing")
    if not (timestamp.isascii() and timestamp.isdigit()) or len(timestamp) > 12:
        raise RequestRefused(f"{TIMESTAMP_HEADER}: must be a number of seconds")
    if abs(now - int(timestamp)) > tolerance:
        raise RequestRefused(
            f"{TIMESTAMP_HEADER}: more than {tolerance} seconds away from now (a replay, or a "
            "clock that is off)"
        )
    expected = signature(secret, timestamp, body)
    if not hmac.compare_digest(expected.encode(), sent.encode("utf-8", "replace")):
        raise RequestRefused(f"{SIGNATURE_HEADER}: does not match the request")
    return sent


@dataclass(frozen=True)
class SlackRequests:
    """The checks of one Slack app: its signing secret, and the leases that refuse replays."""

    secret: str
    seen: LeaseStore
    tolerance: int = TOLERANCE_SECONDS

    def check(self, headers: Mapping[str, str], body: bytes, now: float) -> None:
        """Rules 1 to 4: `RequestRefused` unless Slack signed this request, now, once."""
        if not self.secret:  # an empty key would be anyone's
            raise RequestRefused("Integrations.Slack.SigningSecretEnv: the secret is empty")
        sent = verify(self.secret, headers, body, now, self.tolerance)
        lease = f"slack-request:{sent}"
        if not self.seen.acquire(lease, uuid.uuid4().hex, 2 * self.tolerance * 1000):
            raise RequestRefused(f"{SIGNATURE_HEADER}: this request was already received")

    def __repr__(self) -> str:  # the secret stays out of logs and tracebacks
        return f"SlackRequests(tolerance={self.tolerance})"
