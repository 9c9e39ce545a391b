"""Tenants and their API keys.

A key reads `tjk_<id>_<secret>`. Only the SHA-256 of the whole key is stored; the id finds
the row and the digest is compared in constant time. The key is printed once, at creation.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import time
import uuid
from dataclasses import dataclass
from typing import cast

from sqlalchemy import Table, bindparam, select, update
from sqlalchemy.exc import IntegrityError, SQLAlchemyError

from tracon_jobs.db import Database
from tracon_jobs.db.hot import hot
from tracon_jobs.db.models import ApiKey, Tenant, TenantQuotaOverride
from tracon_jobs.limits.tenant_quotas import OwnQuota
from tracon_jobs.runs.retention import OwnRetention, own_retention, stored_seconds

log = logging.getLogger(__name__)

KEY_PREFIX = "tjk"
TOUCH_EVERY_SECONDS = 60.0
_DUMMY_HASH = hashlib.sha256(b"no such key").hexdigest()
_KEYS = cast(Table, ApiKey.__table__)
_QUOTAS = cast(Table, TenantQuotaOverride.__table__)
_KEY_BY_ID = hot(
    select(
        _KEYS.c.tenant_id,
        _KEYS.c.secret_hash,
        _KEYS.c.revoked_at,
        _QUOTAS.c.tenant_id.label("quota_tenant_id"),
        _QUOTAS.c.period,
        _QUOTAS.c.cost_limit,
    )
    .select_from(_KEYS.outerjoin(_QUOTAS, _QUOTAS.c.tenant_id == _KEYS.c.tenant_id))
    .where(_KEYS.c.id == bindparam("key_id"))
)
"""Built once, in Core: every authenticated request runs it (no ORM, no rebuild). The
tenant's own quota row comes along: a run-starting request checks it, in no read of its own."""


@dataclass(frozen=True)
class Authenticated:
    """Who a valid key belongs to, and that tenant's own quota row as read with it."""

    tenant_id: str
    own_quota: OwnQuota


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
        self._touched: dict[str, float] = {}  # key id -> when this process last wrote its use
        self._names: dict[str, str] = {}  # tenant id -> name

    def create_tenant(self, name: str) -> str:
        with self.db.write() as session:
            tenant = Tenant(id=str(uuid.uuid4()), name=name, created_at=self.db.now())
            session.add(tenant)
        return tenant.id

    def name_of(self, tenant_id: str) -> str | None:
        """A tenant's name (names never change: cached in the process after the first read)."""
        name = self._names.get(tenant_id)
        if name is None:
            with self.db.read() as session:
                name = session.scalar(select(Tenant.name).where(Tenant.id == tenant_id))
            if name is not None:
                self._names[tenant_id] = name
        return name

    def max_concurrent_runs(self, tenant_id: str) -> int | None:
        """The tenant's own most runs at once (None: `Tenants.MaxConcurrentRuns` holds)."""
        with self.db.read() as session:
            return session.scalar(select(Tenant.max_concurrent_runs).where(Tenant.id == tenant_id))

    def set_max_concurrent_runs(self, tenant_id: str, limit: int | None) -> None:
        """Give the tenant a limit of its own, or (None) return it to the default."""
        with self.db.write() as session:
            tenant = session.get(Tenant, tenant_id)
            assert tenant is not None
            tenant.max_concurrent_runs = limit

    def weight(self, tenant_id: str) -> int:
        """The tenant's share of fair dispatch when several tenants have runs lined up."""
        with self.db.read() as session:
            weight = session.scalar(select(Tenant.weight).where(Tenant.id == tenant_id))
        return 1 if weight is None else weight

    def set_weight(self, tenant_id: str, weight: int | None) -> None:
        """Give the tenant a weight of its own, or (None) return it to 1."""
        with self.db.write() as session:
            tenant = session.get(Tenant, tenant_id)
            assert tenant is not None
            tenant.weight = weight

    def weights(self) -> dict[str, int]:
        """Every tenant's weight that is not 1, by tenant id (1 for one set back to 1)."""
        query = select(Tenant.id, Tenant.weight).where(Tenant.weight.is_not(None))
        with self.db.read() as session:
            return {tenant_id: weight or 1 for tenant_id, weight in session.execute(query)}

    def retention(self, tenant_id: str) -> OwnRetention | None:
        """The tenant's own run retention (None: `Runs.Retention` holds)."""
        with self.db.read() as session:
            seconds = session.scalar(select(Tenant.retention_seconds).where(Tenant.id == tenant_id))
        return own_retention(seconds)

    def set_retention(self, tenant_id: str, own: OwnRetention | None) -> None:
        """Give the tenant a run retention of its own, or (None) return it to the setting's."""
        with self.db.write() as session:
            tenant = session.get(Tenant, tenant_id)
            assert tenant is not None
            tenant.retention_seconds = None if own is None else stored_seconds(own)

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
        found = self.authenticate_tenant(key)
        return None if found is None else found.tenant_id

    def authenticate_tenant(self, key: str) -> Authenticated | None:
        """`authenticate`, with the tenant's own quota row (one read for both)."""
        parts = key.split("_", 2)
        key_id = parts[1] if len(parts) == 3 and parts[0] == KEY_PREFIX else ""
        row = None
        if key_id:
            with self.db.read_connection() as connection:
                row = connection.execute(_KEY_BY_ID, {"key_id": key_id}).one_or_none()
        stored = row.secret_hash if row is not None and row.revoked_at is None else _DUMMY_HASH
        matches = hmac.compare_digest(stored, _digest(key))
        if not matches or row is None:
            return None
        self._touch(key_id)
        own = OwnQuota(row.quota_tenant_id is not None, row.period, row.cost_limit)
        return Authenticated(str(row.tenant_id), own)

    def _touch(self, key_id: str) -> None:
        """Record the key's use, at most once a minute per process (a write per request
        would cost every authenticated call a transaction)."""
        now = time.monotonic()
        if now - self._touched.get(key_id, -TOUCH_EVERY_SECONDS) < TOUCH_EVERY_SECONDS:
            return
        self._touched[key_id] = now
        try:
            with self.db.write() as session:
                session.execute(
                    update(_KEYS).where(_KEYS.c.id == key_id).values(last_used_at=self.db.now())
                )
        except SQLAlchemyError as exc:  # bookkeeping: never fails the request
            log.warning("last use of key %s not recorded: %s", key_id, exc)

    def keys(self, tenant_id: str | None = None) -> list[ApiKey]:
        """The keys (of one tenant, or all), oldest first; never their secrets."""
        query = select(ApiKey).order_by(ApiKey.created_at, ApiKey.id)
        if tenant_id is not None:
            query = query.where(ApiKey.tenant_id == tenant_id)
        with self.db.read() as session:
            return list(session.scalars(query))

    def revoke(self, key_id: str) -> bool:
        """Revoke a key at once (every web process checks on each request); False when
        there is no such key or it was revoked already."""
        with self.db.write() as session:
            revoked = session.execute(
                update(_KEYS)
                .where(_KEYS.c.id == key_id, _KEYS.c.revoked_at.is_(None))
                .values(revoked_at=self.db.now())
                .returning(_KEYS.c.id)
            ).scalar_one_or_none()
        return revoked is not None

    def key_active(self, key_id: str, tenant_id: str) -> bool:
        """Whether a key still exists, is the tenant's, and is not revoked."""
        with self.db.read() as session:
            row = session.execute(_KEY_BY_ID, {"key_id": key_id}).one_or_none()
        return row is not None and row.tenant_id == tenant_id and row.revoked_at is None
