"""The Standard Webhooks signature (https://www.standardwebhooks.com): how a receiver knows a
delivery is ours, unaltered and recent.

Three headers travel with every delivery: `webhook-id` (the message's id, the same at every
retry, so a receiver can drop a duplicate), `webhook-timestamp` (unix seconds of this attempt,
so a replayed request grows stale) and `webhook-signature`, a space-separated list of
`v1,<base64 HMAC-SHA256 of "{id}.{timestamp}.{body}">`, one per secret: during a secret's
rotation both the old and the new secret sign, so a receiver holding either accepts the
delivery. A secret is `whsec_<base64 of its key bytes>`, the form every Standard Webhooks
library reads.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import secrets as random_source
import threading
import time
from collections.abc import Mapping, Sequence

SECRET_PREFIX = "whsec_"
"""What every secret starts with, so a receiver's library can tell it from a bare key."""

SECRET_BYTES = 32
"""Random bytes of a new secret's key: 256 bits, as many as the HMAC's output."""

SIGNATURE_VERSION = "v1"
"""The scheme's tag for HMAC-SHA256 signatures (`v1a` would be the asymmetric one)."""

TOLERANCE = 300
"""Seconds a receiver accepts between a delivery's timestamp and its own clock, either way:
the five minutes of the reference libraries."""

MESSAGE_ID_PREFIX = "msg_"
"""What every message id starts with, the Standard Webhooks libraries' convention."""

_CROCKFORD = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"
"""The ULID alphabet: base 32 without I, L, O, U, whose order is the order of its values."""


class SignatureError(Exception):
    """A delivery that does not prove to come from the secret's holder: a header missing or
    malformed, a timestamp outside the tolerance, or no signature that matches."""


def new_secret() -> str:
    """A fresh endpoint secret, from the operating system's random source."""
    return SECRET_PREFIX + base64.b64encode(random_source.token_bytes(SECRET_BYTES)).decode()


def secret_key(secret: str) -> bytes:
    """The HMAC key of a `whsec_...` secret; ValueError naming what is wrong with a malformed
    one, so a bad secret fails where it is configured rather than as unverifiable deliveries.
    Missing base64 padding is accepted, as the reference libraries accept it."""
    if not secret.startswith(SECRET_PREFIX):
        raise ValueError(f"a webhook secret must start with {SECRET_PREFIX!r}")
    encoded = secret.removeprefix(SECRET_PREFIX)
    try:
        key = base64.b64decode(encoded + "=" * (-len(encoded) % 4), validate=True)
    except binascii.Error:
        raise ValueError(f"a webhook secret must be {SECRET_PREFIX!r} and base64") from None
    if not key:
        raise ValueError(f"a webhook secret must have a key after {SECRET_PREFIX!r}")
    return key


def sign(message_id: str, timestamp: int, body: bytes, secrets: Sequence[str]) -> str:
    """The `webhook-signature` value: one `v1,...` per secret, in the order given (the new
    secret and the old one during a rotation's grace period)."""
    if not secrets:
        raise ValueError("a webhook needs at least one secret to be signed")
    return " ".join(
        _signature(secret_key(secret), message_id, timestamp, body) for secret in secrets
    )


def headers(message_id: str, timestamp: int, body: bytes, secrets: Sequence[str]) -> dict[str, str]:
    """Every header a delivery carries besides the transport's own."""
    return {
        "content-type": "application/json",
        "webhook-id": message_id,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": sign(message_id, timestamp, body, secrets),
    }


def verify(
    secret: str, headers: Mapping[str, str], body: bytes, now: int, tolerance: int = TOLERANCE
) -> None:
    """Check a delivery as a receiver must; SignatureError when it does not hold.

    For receivers written in Python (and our tests): pass the endpoint's secret, the request's
    headers (any case), the raw body bytes as received (not re-serialized JSON) and the current
    unix time. The comparison runs in constant time, and a timestamp more than `tolerance`
    seconds away from `now` is refused, so a captured request cannot be replayed later::

        try:
            verify(SECRET, dict(request.headers), request.get_data(), int(time.time()))
        except SignatureError:
            abort(401)

    A message id should also be remembered for a while, to drop the rare duplicate delivery.
    """
    found = {name.lower(): value for name, value in headers.items()}
    message_id = _required(found, "webhook-id")
    timestamp = _timestamp(_required(found, "webhook-timestamp"), now, tolerance)
    expected = _digest(secret_key(secret), message_id, timestamp, body)
    if not any(
        hmac.compare_digest(expected, given)
        for given in _offered(_required(found, "webhook-signature"))
    ):
        raise SignatureError("no signature matches the secret")


def _signature(key: bytes, message_id: str, timestamp: int, body: bytes) -> str:
    encoded = base64.b64encode(_digest(key, message_id, timestamp, body)).decode()
    return f"{SIGNATURE_VERSION},{encoded}"


def _digest(key: bytes, message_id: str, timestamp: int, body: bytes) -> bytes:
    signed = f"{message_id}.{timestamp}.".encode() + body
    return hmac.new(key, signed, hashlib.sha256).digest()


def _required(headers: Mapping[str, str], name: str) -> str:
    value = headers.get(name, "").strip()
    if not value:
        raise SignatureError(f"missing header {name}")
    return value


def _timestamp(value: str, now: int, tolerance: int) -> int:
    if not value.isascii() or not value.isdigit():
        raise SignatureError(f"webhook-timestamp is not unix seconds: {value[:32]!r}")
    timestamp = int(value)
    if timestamp < now - tolerance:
        raise SignatureError(f"webhook-timestamp is too old ({now - timestamp} s)")
    if timestamp > now + tolerance:
        raise SignatureError(f"webhook-timestamp is in the future ({timestamp - now} s)")
    return timestamp


def _offered(header: str) -> list[bytes]:
    """The `v1` signatures of a `webhook-signature` value; other versions and undecodable
    entries are skipped, as the scheme asks (a sender may add versions we do not know)."""
    offered = []
    for entry in header.split():
        version, _, encoded = entry.partition(",")
        if version != SIGNATURE_VERSION:
            continue
        try:
            offered.append(base64.b64decode(encoded, validate=True))
        except binascii.Error:
            continue
    return offered


class _MessageIds:
    """ULID-like ids: 48 bits of milliseconds, then 80 random bits, in Crockford base 32, so
    ids sort by creation time as strings. Within one millisecond the random part counts up
    (ULID's monotonic rule), so ids of one process also sort in the order they were made."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last_ms = -1
        self._last_random = 0

    def next(self) -> str:
        with self._lock:
            ms, random = self._advance(time.time_ns() // 1_000_000)
        return _base32(ms, 10) + _base32(random, 16)

    def _advance(self, ms: int) -> tuple[int, int]:
        if ms > self._last_ms:
            self._last_ms, self._last_random = ms, random_source.randbits(80)
        elif self._last_random < (1 << 80) - 1:
            self._last_random += 1
        else:  # a millisecond's random part spent: borrow the next millisecond
            self._last_ms, self._last_random = self._last_ms + 1, random_source.randbits(79)
        return self._last_ms, self._last_random


def _base32(value: int, width: int) -> str:
    digits = []
    for _ in range(width):
        value, digit = divmod(value, 32)
        digits.append(_CROCKFORD[digit])
    return "".join(reversed(digits))


_ids = _MessageIds()


def message_id() -> str:
    """A new message id, `msg_` and 26 characters that sort by time: the outbox's rows and the
    receivers' logs list messages in the order they were made."""
    return MESSAGE_ID_PREFIX + _ids.next()
