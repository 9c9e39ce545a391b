"""The Standard Webhooks signature: our headers verify with the scheme's reference library,
what the library signs verifies with ours, and a delivery altered, signed with another
secret or replayed late is refused."""

from __future__ import annotations

import base64
import time
from datetime import UTC, datetime

import pytest
from standardwebhooks.webhooks import Webhook, WebhookVerificationError

from tracon_jobs.webhooks import signing
from tracon_jobs.webhooks.signing import SignatureError

SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
OTHER_SECRET = "whsec_" + base64.b64encode(b"another key of the endpoint, 32b").decode()
BODY = b'{"type": "run.completed", "data": {"id": "run_1", "name": "caf\xc3\xa9"}}'
ULID_ALPHABET = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"


def test_the_signature_of_the_schemes_published_example() -> None:
    # The example of the Standard Webhooks specification and its libraries' tests.
    body = b'{"test": 2432232314}'
    signature = signing.sign("msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330, body, [SECRET])
    assert signature == "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="


def test_headers_round_trip_through_verify() -> None:
    now = int(time.time())
    headers = signing.headers("msg_1", now, BODY, [SECRET])

    assert headers["content-type"] == "application/json"
    assert headers["webhook-id"] == "msg_1"
    assert headers["webhook-timestamp"] == str(now)
    signing.verify(SECRET, headers, BODY, now=now)
    upper = {name.upper(): value for name, value in headers.items()}
    signing.verify(SECRET, upper, BODY, now=now + 10)  # header names in any case


def test_two_secrets_give_two_signatures_each_verifying_alone() -> None:
    now = int(time.time())
    headers = signing.headers("msg_2", now, BODY, [OTHER_SECRET, SECRET])

    signatures = headers["webhook-signature"].split(" ")
    assert [entry.split(",")[0] for entry in signatures] == ["v1", "v1"]
    assert signatures[0] == signing.sign("msg_2", now, BODY, [OTHER_SECRET])
    assert signatures[1] == signing.sign("msg_2", now, BODY, [SECRET])
    signing.verify(SECRET, headers, BODY, now=now)
    signing.verify(OTHER_SECRET, headers, BODY, now=now)


def test_the_reference_library_verifies_our_headers() -> None:
    now = int(time.time())
    for secrets in ([SECRET], [OTHER_SECRET, SECRET]):
        headers = signing.headers(signing.message_id(), now, BODY, secrets)
        assert Webhook(SECRET).verify(BODY, headers)["data"]["id"] == "run_1"
    with pytest.raises(WebhookVerificationError):
        Webhook(SECRET).verify(BODY + b" ", headers)


def test_we_verify_what_the_reference_library_signs() -> None:
    now = int(time.time())
    signature = Webhook(SECRET).sign("msg_3", datetime.fromtimestamp(now, UTC), BODY.decode())
    headers = {"webhook-id": "msg_3", "webhook-timestamp": str(now), "webhook-signature": signature}

    signing.verify(SECRET, headers, BODY, now=now)
    with pytest.raises(SignatureError):
        signing.verify(OTHER_SECRET, headers, BODY, now=now)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"body": BODY.replace(b"run_1", b"run_2")}, "no signature matches"),
        ({"secret": OTHER_SECRET}, "no signature matches"),
        ({"now": 1_000_000 + 301}, "too old"),
        ({"now": 1_000_000 - 301}, "in the future"),
        ({"webhook-id": "msg_other"}, "no signature matches"),
        ({"webhook-timestamp": "1000001"}, "no signature matches"),
        ({"webhook-timestamp": "1e6"}, "not unix seconds"),
        ({"webhook-signature": "v2,abc v1,!!!"}, "no signature matches"),
        ({"webhook-signature": ""}, "missing header webhook-signature"),
        ({"webhook-id": ""}, "missing header webhook-id"),
    ],
)
def test_an_altered_or_late_delivery_is_refused(change: dict[str, object], message: str) -> None:
    headers = signing.headers("msg_4", 1_000_000, BODY, [SECRET])
    signing.verify(SECRET, headers, BODY, now=1_000_000 + 300)  # the tolerance's edge holds
    for name in ("webhook-id", "webhook-timestamp", "webhook-signature"):
        if name in change:
            headers[name] = str(change[name])
    body = change.get("body", BODY)
    secret = change.get("secret", SECRET)
    now = change.get("now", 1_000_000)
    assert isinstance(body, bytes) and isinstance(secret, str) and isinstance(now, int)

    with pytest.raises(SignatureError, match=message):
        signing.verify(secret, headers, body, now=now)


def test_a_smaller_tolerance_refuses_sooner() -> None:
    headers = signing.headers("msg_5", 1_000_000, BODY, [SECRET])
    with pytest.raises(SignatureError, match="too old"):
        signing.verify(SECRET, headers, BODY, now=1_000_011, tolerance=10)


def test_new_secrets_are_fresh_32_byte_keys_the_reference_library_reads() -> None:
    first, second = signing.new_secret(), signing.new_secret()

    assert first.startswith("whsec_") and first != second
    assert len(signing.secret_key(first)) == 32
    headers = signing.headers("msg_6", int(time.time()), BODY, [first])
    Webhook(first).verify(BODY, headers)


def test_a_secret_without_padding_reads_as_the_reference_library_reads_it() -> None:
    padded = "whsec_" + base64.b64encode(b"0123456789abcdefghij").decode()
    unpadded = padded.rstrip("=")
    assert unpadded != padded

    assert signing.secret_key(unpadded) == b"0123456789abcdefghij"
    headers = signing.headers("msg_9", int(time.time()), BODY, [unpadded])
    Webhook(unpadded).verify(BODY, headers)


@pytest.mark.parametrize(
    ("secret", "message"),
    [
        ("MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw", "must start with 'whsec_'"),
        ("WHSEC_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw", "must start with 'whsec_'"),
        ("whsec_", "must have a key"),
        ("whsec_not base64!", "base64"),
        ("whsec_MfKQ9r8G*YqrTwjU", "base64"),
    ],
)
def test_a_malformed_secret_is_refused(secret: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        signing.secret_key(secret)
    with pytest.raises(ValueError, match=message):
        signing.sign("msg_7", 1, BODY, [SECRET, secret])


def test_signing_needs_a_secret() -> None:
    with pytest.raises(ValueError, match="at least one secret"):
        signing.sign("msg_8", 1, BODY, [])


def _milliseconds(message_id: str) -> int:
    """The time part of an id, read by the ULID layout (10 base-32 digits of milliseconds)."""
    value = 0
    for digit in message_id.removeprefix("msg_")[:10]:
        value = value * 32 + ULID_ALPHABET.index(digit)
    return value


def test_message_ids_are_unique_and_sort_by_time() -> None:
    before = time.time_ns() // 1_000_000
    ids = [signing.message_id() for _ in range(5000)]
    after = time.time_ns() // 1_000_000

    assert len(set(ids)) == len(ids)
    assert sorted(ids) == ids  # one millisecond holds many: the random part counts up
    assert all(len(id_) == 30 and id_.startswith("msg_") for id_ in ids)
    assert all(set(id_[4:]) <= set(ULID_ALPHABET) for id_ in ids)
    assert before <= _milliseconds(ids[0]) <= _milliseconds(ids[-1]) <= after + 1


def test_a_later_millisecond_sorts_after_any_random_part() -> None:
    first = signing.message_id()
    while time.time_ns() // 1_000_000 <= _milliseconds(first):
        pass  # the next millisecond, a spin of at most one
    later = signing.message_id()

    assert _milliseconds(later) > _milliseconds(first)
    assert later > first
