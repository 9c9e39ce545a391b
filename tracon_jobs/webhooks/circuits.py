"""`circuit.opened` and `circuit.closed`: a provider's circuit moves in Redis, so its messages are
moved from Redis into the outbox.

When the operator's endpoint subscribes to them, the breaker's script (`breaker_record.lua`,
given `transitions_key`) pushes each move onto the provider's own Redis list in the same script
that makes it: no move without its entry, no entry without its move. The list is tagged with
the provider (`tracon:webhooks:circuit-transitions:{P}`), in the circuit's own hash slot, so
the script runs on a Redis Cluster too. `CircuitEvents.move_once` reads the lists of the
configured providers, and the one list earlier versions pushed every move onto
(`TRANSITIONS_KEY`: entries a process of the version before an upgrade wrote are moved too),
copies the entries into `webhook_messages`, each keyed by its entry (`dedupe_key`: provider,
the script's server time and the circuit's own count of moves), commits, then removes exactly
those entries from their lists: at least once, never twice, however many processes move at the
same time. The process whose call moved the circuit moves at once (on the mover's thread, not
the run's); every process with a breaker also moves every `Webhooks.PollInterval`, so an entry
whose process died right after the script is moved by another.

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
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final, cast

from sqlalchemy import Table
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.sql.dml import Insert

from tracon_jobs.coordination.cluster import CoordinationClient
from tracon_jobs.db import Database
from tracon_jobs.db.models import WebhookMessage
from tracon_jobs.webhooks.signing import message_id
from tracon_jobs.webhooks.subscriptions import Subscriptions

log = logging.getLogger(__name__)

MESSAGES = cast(Table, WebhookMessage.__table__)

TRANSITIONS_KEY: Final = "tracon:webhooks:circuit-transitions"
"""The one list of every provider's moves that earlier versions pushed onto: drained still, so
an upgrade loses none (a cluster refuses a script that writes it beside a circuit's keys)."""


def transitions_key(provider: str) -> str:
    """The list the breaker's script pushes the provider's moves onto: in the slot of the
    provider's circuit (`tracon:breaker:{P}`), tagged alike."""
    return f"{TRANSITIONS_KEY}:{{{provider}}}"


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
    """Moves circuit transitions from their Redis lists into the outbox (module docstring).

    `providers` are the providers whose lists are read (the configured ones: a circuit is a
    configured provider's); the one list of earlier versions, `key`, is read with them, and,
    from the mover's start, the lists of providers since removed from the configuration
    (`discover`)."""

    def __init__(
        self,
        client: CoordinationClient,
        db: Database,
        subscriptions: Subscriptions,
        view: CircuitView,
        *,
        wake: Callable[[int], None],
        providers: Iterable[str] = (),
        key: str = TRANSITIONS_KEY,
        poll_seconds: float = 1.0,
        batch: int = MOVE_BATCH,
    ) -> None:
        self.client = client
        self.db = db
        self.subscriptions = subscriptions
        self.view = view
        self.wake = wake
        self.keys = [*(transitions_key(provider) for provider in providers), key]
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
        """(entries taken, messages new): up to `batch` entries of each list, copied and
        committed first, then removed from the list each came from.

        The lists are read in one pipeline (not a transaction: on a cluster each goes to its
        node, one command a key) and the removals go in another."""
        pipe = self.client.pipeline(transaction=False)
        for key in self.keys:
            pipe.lrange(key, 0, self.batch - 1)
        taken = {
            key: cast(list[bytes], entries)
            for key, entries in zip(self.keys, pipe.execute(), strict=True)
            if entries
        }
        if not taken:
            return 0, 0
        entries = [entry for listed in taken.values() for entry in listed]
        moves = [move for move in map(parse, entries) if move is not None]
        wanted = self.subscriptions.current()
        written = self._write([m for m in moves if wanted.wants(m.type)])
        pipe = self.client.pipeline(transaction=False)
        for key, listed in taken.items():
            for entry in listed:
                pipe.lrem(key, 1, entry)  # type: ignore[arg-type]  # bytes, as read
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

    def discover(self) -> list[str]:
        """Add the moves lists of providers no longer configured (a list left by a process
        of the configuration before): found once, as the mover starts, by a `SCAN` of their
        names (every node of a cluster); the keys added."""
        found = {
            key.decode() if isinstance(key, bytes) else str(key)
            for key in self.client.scan_iter(match=f"{TRANSITIONS_KEY}:*", count=1000)
        }
        added = sorted(found - set(self.keys))
        self.keys.extend(added)
        return added

    def _run(self) -> None:
        try:
            for key in self.discover():
                log.info("circuit moves of a provider no longer configured: moving %s", key)
        except Exception as exc:  # Redis away: the configured providers' lists still move
            log.warning("circuit moves lists not looked for: %s", exc)
        while not self._stopped.is_set():
            self._due.wait(self.poll_seconds)
            self._due.clear()
            if self._stopped.is_set():
                return
            try:
                while self.move_batch()[0] >= self.batch:
                    pass  # a list's batch may have been full: more may wait
            except Exception as exc:  # Redis or SQL away: the entries wait in Redis
                log.warning("circuit transitions not moved to the outbox yet: %s", exc)
