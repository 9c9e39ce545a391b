"""A tenant's live event streams, counted across every web process: at most N open at once.

Each open stream holds a place: a lease in a sorted set per tenant, renewed by the process
that serves the stream and given back the moment the stream ends (its client went away, or
the run ended). A web process that dies without giving its places back loses them when their
leases run out, so a crash never locks a tenant out for longer than `LEASE_MS`.
"""

from __future__ import annotations

import uuid
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

from tracon_jobs.coordination.cluster import CoordinationClient
from tracon_jobs.coordination.scripts import Scripts

LEASE_MS = 60_000
RENEW_SECONDS = LEASE_MS / 3000


@dataclass(frozen=True)
class StreamPlace:
    tenant_id: str
    id: str = field(default_factory=lambda: uuid.uuid4().hex)


class StreamPlaces:
    """The places of live streams, per tenant, in Redis."""

    def __init__(self, client: CoordinationClient, limit: int, prefix: str = "tracon") -> None:
        self.client = client
        self.limit = limit
        self.prefix = prefix
        self.scripts = Scripts(client)

    def key(self, tenant_id: str) -> str:
        return f"{self.prefix}:streams:{{{tenant_id}}}"

    def take(self, tenant_id: str) -> StreamPlace | None:
        """A place for one more stream of the tenant, or None when all are taken."""
        place = StreamPlace(tenant_id)
        held = self.scripts(
            "stream_acquire", [self.key(tenant_id)], [place.id, self.limit, LEASE_MS]
        )
        return place if held else None

    def give_back(self, place: StreamPlace) -> None:
        self.give_back_all([place])

    def give_back_all(self, places: Iterable[StreamPlace]) -> None:
        """Give back many places in one round trip (a `ZREM` per tenant)."""
        by_tenant = self.by_tenant(places)
        if not by_tenant:
            return
        if len(by_tenant) == 1:
            [(tenant_id, ids)] = by_tenant.items()
            self.client.zrem(self.key(tenant_id), *ids)
            return
        pipe = self.client.pipeline(transaction=False)
        for tenant_id, ids in by_tenant.items():
            pipe.zrem(self.key(tenant_id), *ids)
        pipe.execute()

    def renew(self, places: Iterable[StreamPlace]) -> None:
        for tenant_id, ids in self.by_tenant(places).items():
            self.scripts("stream_renew", [self.key(tenant_id)], [LEASE_MS, *ids])

    @staticmethod
    def by_tenant(places: Iterable[StreamPlace]) -> dict[str, list[str]]:
        ids: dict[str, list[str]] = defaultdict(list)
        for place in places:
            ids[place.tenant_id].append(place.id)
        return ids

    def held(self, tenant_id: str) -> int:
        """Places the tenant holds now (leases that ran out included until the next take)."""
        return int(self.client.zcard(self.key(tenant_id)))
