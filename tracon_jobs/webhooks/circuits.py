"""`circuit.opened` and `circuit.closed`: a provider's circuit moves in Redis, so its messages are
moved from Redis into the outbox.

When the operator's endpoint subscribes to them, the breaker's script (`breaker_record.lua`,
given `TRANSITIONS_KEY`) pushes each move onto a Redis list in the same script that makes it:
no move without its entry, no entry without its move. `CircuitEvents.move_once` copies the
entries into `webhook_messages`, each keyed by its entry (`dedupe_key`: provider, the script's
server time and the circuit's own count of moves), commits, then removes exactly those entries
from the list: at least once, never twice, however many processes move at the same time. The
process whose call moved the circuit moves at once (on the mover's thread, not the run's);
every process with a breaker also moves every `Webhooks.PollInterval`, so an entry whose
process died right after the script is moved by another.

    closed -> open, half_open -> open    circuit.opened
    half_open -> closed                  circuit.closed
    open -> half_open                    (no message: the break ended, a probe is let through)

What can still be lost is what Redis itself loses (a flush, a failover before replication):
the circuit's state goes with it, so no message tells of a move that is gone.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final, cast

import redis
from sqlalchemy import Table
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.sql.dml import Insert

from tracon_jobs.db import Database
from tracon_jobs.db.models import WebhookMessage
from tracon_jobs.webhooks.signing import message_id
from tracon_jobs.webhooks.subscriptions import Subscriptions

log = logging.getLogger(__name__)

MESSAGES = cast(Table, WebhookMessage.__table__)

TRANSITIONS_KEY: Final = "tracon:webhooks:circuit-transitions"
"""The Redis list the breaker's script pushes each move onto."""

CIRCUIT_EVENTS: Final = frozenset({"circuit.opened", "circuit.closed"})

MOVE_BATCH: Final = 100
"""Entries copied in one transaction, by default."""

CircuitView = Callable[[str], dict[str, Any]]
"""A provider's circuit as `GET /api/circuits` shows it now."""


@dataclass(frozen=True)
class Move:
    """One entry of the list: a circuit's move, as the script saw it."""

    entry: bytes
    provider: str
    before: str
    after: str
    failures: int
    open_until_ms: int
    at_ms: int
    count: int

    @property
    def type(self) -> str:
        return "circuit.closed" if self.after == "closed" else "circuit.opened"

    @property
    def dedupe_key(self) -> str:
        return f"circuit:{self.provider}:{self.at_ms}:{self.count}"

    @property
    def at(self) -> datetime:
        return datetime.fromtimestamp(self.at_ms / 1000, UTC).replace(tzinfo=None)

    def circuit(self, now: dict[str, Any]) -> dict[str, Any]:
        """The circuit as `GET /api/circuits` showed it right after the move: its state as
        the move left it, its slots and rate limits as they are now."""
        opened = self.after == "open"
        retry = max(self.open_until_ms - self.at_ms, 0) / 1000 if opened else None
        return {
            **now,
            "state": self.after,
            "consecutiveFailures": self.failures,
            "retryAfter": retry or None,
            "probesInFlight": 0,  # a move ends every probe
        }


def parse(entry: bytes) -> Move | None:
    """The move an entry tells; None for one that does not parse (it is dropped, logged)."""
    try:
        fields = json.loads(entry)
        return Move(
            entry,
            str(fields["provider"]),
            str(fields["before"]),
            str(fields["after"]),
            int(fields["failures"]),
            int(fields["openUntil"]),
            int(fields["at"]),
            int(fields["n"]),
        )
    except (ValueError, KeyError, TypeError) as exc:
        log.warning("circuit transition entry dropped, unreadable: %r (%s)", entry[:200], exc)
        return None


def circuit_insert(on_sqlite: bool) -> Insert:
    """An operator message (no tenant), written once by its key; it returns its id when new."""
    dialect_insert = sqlite.insert if on_sqlite else postgresql.insert
    return (
        dialect_insert(MESSAGES)
        .on_conflict_do_nothing(index_elements=[MESSAGES.c.dedupe_key])
        .returning(MESSAGES.c.id)
    )


class CircuitEvents:
    """Moves circuit transitions from their Redis list into the outbox (module docstring)."""

    def __init__(
        self,
        client: redis.Redis,
        db: Database,
        subscriptions: Subscriptions,
        view: CircuitView,
        *,
        wake: Callable[[int], None],
        key: str = TRANSITIONS_KEY,
        poll_seconds: float = 1.0,
        batch: int = MOVE_BATCH,
    ) -> None:
        self.client = client
        self.db = db
        self.subscriptions = subscriptions
        self.view = view
        self.wake = wake
        self.key = key
        self.poll_seconds = poll_seconds
        self.batch = batch
        self._due = threading.Event()
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def soon(self, _provider: str = "", _change: object = None) -> None:
        """A circuit moved (`CircuitBreaker.on_transition`): move its entry now, on the mover's
        thread, so the run that saw it does not wait for SQL."""
        self.start()
        self._due.set()

    def start(self) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._stopped.clear()
                self._thread = threading.Thread(
                    target=self._run, name="webhook-circuits", daemon=True
                )
                self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        self._due.set()

    def move_once(self) -> int:
        """Copy up to `batch` entries into the outbox, then remove them from the list;
        how many messages are new."""
        return self.move_batch()[1]

    def move_batch(self) -> tuple[int, int]:
        """(entries taken, messages new): copied and committed first, removed after."""
        entries = cast(list[bytes], self.client.lrange(self.key, 0, self.batch - 1))
        if not entries:
            return 0, 0
        moves = [move for move in map(parse, entries) if move is not None]
        wanted = self.subscriptions.current()
        written = self._write([m for m in moves if wanted.wants(m.type)])
        pipe = self.client.pipeline(transaction=False)
        for entry in entries:
            pipe.lrem(self.key, 1, entry)  # type: ignore[arg-type]  # bytes, as read
        pipe.execute()
        if written:
            self.wake(written)
        return len(entries), written

    def _write(self, moves: Sequence[Move]) -> int:
        if not moves:
            return 0
        rows = [self._row(move) for move in moves]
        statement = circuit_insert(self.db.is_sqlite)
        with self.db.write() as session:
            return sum(1 for row in rows if session.execute(statement, row).first() is not None)

    def _row(self, move: Move) -> dict[str, Any]:
        return {
            "id": message_id(),
            "tenant_id": None,
            "type": move.type,
            "subject_id": move.provider,
            "data": move.circuit(self.view(move.provider)),
            "dedupe_key": move.dedupe_key,
            "created_at": move.at,
        }

    def _run(self) -> None:
        while not self._stopped.is_set():
            self._due.wait(self.poll_seconds)
            self._due.clear()
            if self._stopped.is_set():
                return
            try:
                while self.move_batch()[0] == self.batch:
                    pass  # a full batch: more may wait
            except Exception as exc:  # Redis or SQL away: the entries wait in Redis
                log.warning("circuit transitions not moved to the outbox yet: %s", exc)
