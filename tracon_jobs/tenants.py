"""Tenants and their API keys.

A key reads `tjk_<id>_<secret>`. Only the SHA-256 of the whole key is stored; the id finds
the row and the digest is compared in constant time. The key is printed once, at creation.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import uuid
from dataclasses import dataclass
from typing import cast

from sqlalchemy import Table, bindparam, select
from sqlalchemy.exc import IntegrityError

from tracon_jobs.db import Database
from tracon_jobs.db.models import ApiKey, Tenant

KEY_PREFIX = "tjk"
_DUMMY_HASH = hashlib.sha256(b"no such key").hexdigest()
_KEYS = cast(Table, ApiKey.__table__)
_KEY_BY_ID = select(_KEYS.c.tenant_id, _KEYS.c.secret_hash, _KEYS.c.revoked_at).where(
    _KEYS.c.id == bindparam("key_id")
)
"""Built once, in Core: every authenticated request runs it (no ORM, no rebuild)."""


@dataclass(frozen=True)
class IssuedKey:
    tenant_id: str
    key_id: str
    secret: str  # the whole key, shown once


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class TenantStore:
    """Tenants and their API keys (kept hashed, compared in constant time)."""

    def __init__(self, db: Database) -> None:
        self.db = db

    def create_tenant(self, name: str) -> str:
        with self.db.write() as session:
            tenant = Tenant(id=str(uuid.uuid4()), name=name, created_at=self.db.now())
            session.add(tenant)
        return tenant.id

    def find_tenant(self, name_or_id: str) -> str | None:
        query = select(Tenant.id).where((Tenant.name == name_or_id) | (Tenant.id == name_or_id))
        with self.db.read() as session:
            return session.scalars(query).first()

    def ensure_tenant(self, name: str) -> str:
        """The tenant's id, creating it once even when callers race."""
        found = self.find_tenant(name)
        if found is not None:
            return found
        try:
            return self.create_tenant(name)
        except IntegrityError:
            raced = self.find_tenant(name)
            assert raced is not None
            return raced

    def issue_key(self, tenant_id: str, label: str = "") -> IssuedKey:
        key_id = secrets.token_hex(8)
        key = f"{KEY_PREFIX}_{key_id}_{secrets.token_urlsafe(32)}"
        with self.db.write() as session:
            session.add(
                ApiKey(
                    id=key_id,
                    tenant_id=tenant_id,
                    secret_hash=_digest(key),
                    label=label,
                    created_at=self.db.now(),
                )
            )
        return IssuedKey(tenant_id=tenant_id, key_id=key_id, secret=key)

    def authenticate(self, key: str) -> str | None:
        """The tenant id of a valid, unrevoked key; None otherwise, in constant time."""
        parts = key.split("_", 2)
        key_id = parts[1] if len(parts) == 3 and parts[0] == KEY_PREFIX else ""
        row = None
        if key_id:
            with self.db.read() as session:
                row = session.execute(_KEY_BY_ID, {"key_id": key_id}).one_or_none()
        stored = row.secret_hash if row is not None and row.revoked_at is None else _DUMMY_HASH
        matches = hmac.compare_digest(stored, _digest(key))
        return row.tenant_id if matches and row is not None else None
