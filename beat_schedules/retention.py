"""Delete idempotency records older than `Retention.Idempotency`, when retention is on.

A record that outlived the retention is no longer a promise anyone relies on: a client
retrying a day later is making a new request. Deleting both states is deliberate: an
`InProgress` record that old is a crash nobody resolved, and keeping it forever would
block that key forever.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING

from tracon_jobs.idempotency import IdempotencyStore

if TYPE_CHECKING:
    from tracon_jobs.runtime import Runtime


@dataclass(frozen=True)
class PurgeResult:
    enabled: bool
    deleted: int = 0


def scan_once(runtime: Runtime, now: datetime) -> PurgeResult:
    retention = runtime.settings.retention.idempotency_retention
    if retention is None:
        return PurgeResult(enabled=False)
    return PurgeResult(enabled=True, deleted=IdempotencyStore(runtime.db).purge(retention, now))
