"""One-time approval links: a signed URL per approval that a person opens from an email or a
chat message, whose `GET` shows what would be decided and whose `POST` decides.

A token is the urlsafe base64 (no padding) of `<approval id>.<expiry, unix seconds>.` and the
raw HMAC-SHA256 of that text under the key of `Integrations.ApprovalLinks.SecretEnv`. It
holds no secret of its own and no tenant: the approval names its tenant, and the decision
still goes through the once-only path, so the link is "one-time" because the approval can be
decided once, whatever number of times the link is opened. It expires with its approval.

Why a `GET` never decides: mail scanners, chat unfurlers and browsers' prefetchers open links
before a person does. Only the form on the page, posted by the person, decides.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import re
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any, Final

from tracon_jobs.db.models import Approval
from tracon_jobs.errors import ConfigurationError
from tracon_jobs.settings.sections import ApprovalLinksSettings

MIN_SECRET_CHARS: Final = 32
"""The shortest signing key accepted: a shorter one could be guessed offline from a link."""

MAC_BYTES: Final = hashlib.sha256().digest_size
_ALPHABET: Final = re.compile(r"[A-Za-z0-9_-]{1,400}")
PATH: Final = "/approvals/links/"
"""Where the links point under `PublicUrl` (the web's `integrations` blueprint)."""


class LinkRefused(ValueError):
    """A token this installation did not sign, or not in the shape it signs: the page is 404."""


class LinkExpired(Exception):
    """A genuine link whose approval's time is over: the page says so."""

    def __init__(self, approval_id: str) -> None:
        super().__init__(f"the link of approval '{approval_id}' has expired")
        self.approval_id = approval_id


class ApprovalLinks:
    """Signs and checks the links of one installation (one key, one public address)."""

    def __init__(self, secret: str, public_url: str) -> None:
        if len(secret) < MIN_SECRET_CHARS:
            raise ValueError(f"the signing key must have at least {MIN_SECRET_CHARS} characters")
        self._key = secret.encode()
        self.public_url = public_url.rstrip("/")

    def link_for(self, approval_id: str, expires_at: datetime) -> str:
        """The URL that decides `approval_id`, good until `expires_at` (naive means UTC)."""
        return f"{self.public_url}{PATH}{self.token_for(approval_id, expires_at)}"

    def token_for(self, approval_id: str, expires_at: datetime) -> str:
        text = f"{approval_id}.{_unix(expires_at)}.".encode()
        return _b64(text + self._mac(text))

    def verify(self, token: str, now: datetime) -> str:
        """The approval id a token signs; `LinkRefused` when it was not signed here (or was
        changed), `LinkExpired` once `now` reaches its expiry."""
        text, mac = _split(token)
        if not hmac.compare_digest(mac, self._mac(text)):
            raise LinkRefused("the link's signature does not match")
        approval_id, expiry = _fields(text)
        if _unix(now) >= expiry:
            raise LinkExpired(approval_id)
        return approval_id

    def links(self, approval: Approval) -> dict[str, Any]:
        """The `links` of an approval's webhook payload (`webhooks.render.Links`)."""
        return {"decide": self.link_for(approval.id, approval.expires_at)}

    def _mac(self, text: bytes) -> bytes:
        return hmac.new(self._key, text, hashlib.sha256).digest()


def approval_links(
    settings: ApprovalLinksSettings | None, environ: Mapping[str, str]
) -> ApprovalLinks | None:
    """The links of `Integrations.ApprovalLinks`, None when they are not configured. The key
    is read once, here, as the process starts: a short one fails the startup, named."""
    if settings is None:
        return None
    secret = environ.get(settings.secret_env, "")
    try:
        return ApprovalLinks(secret, settings.public_url)
    except ValueError as exc:
        raise ConfigurationError(
            "Integrations.ApprovalLinks.SecretEnv", f"{settings.secret_env}: {exc}"
        ) from None


def payload_links(
    links: ApprovalLinks | None,
) -> Callable[[Approval], dict[str, Any] | None] | None:
    """The `links` hook of `webhooks.render.render` (its `Links`): each approval payload gets
    `"links": {"decide": <url>}`; None when links are not configured (no `links` key)."""
    return None if links is None else links.links


def _split(token: str) -> tuple[bytes, bytes]:
    if not _ALPHABET.fullmatch(token):  # the decoder would skip stray characters silently
        raise LinkRefused("the link is not urlsafe base64")
    try:
        raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
    except (binascii.Error, ValueError):
        raise LinkRefused("the link is not base64") from None
    text, mac = raw[:-MAC_BYTES], raw[-MAC_BYTES:]
    if len(mac) != MAC_BYTES or not text.endswith(b"."):
        raise LinkRefused("the link is too short")
    return text, mac


def _fields(text: bytes) -> tuple[str, int]:
    """(approval id, expiry) of a signed text; a signed text always parses, so a failure here
    means the key signed something else (never a link)."""
    approval_id, _, expiry = text[:-1].decode().rpartition(".")
    if not approval_id or not expiry.isdigit():
        raise LinkRefused("the link's fields are not an approval and an expiry")
    return approval_id, int(expiry)


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _unix(moment: datetime) -> int:
    aware = moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)
    return int(aware.timestamp())
