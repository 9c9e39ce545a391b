"""Cancel notices: tell every worker process at once that a run was asked to stop.

The request itself is persisted in SQL before anyone is told (`runs.cancel_requested_at`);
the notice only makes delivery fast. A notice lost to a Redis restart costs at most one
poll interval of the worker's live-run registry, which reads the persisted request.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from typing import Protocol

import redis

log = logging.getLogger(__name__)

Listener = Callable[[str], None]


class CancelBus(Protocol):
    def publish(self, run_id: str) -> None: ...

    def subscribe(self, listener: Listener) -> None:
        """Call `listener(run_id)` for every notice from now on (on a background thread)."""
        ...


class RedisCancelBus:
    """Redis pub/sub on one channel; a listener thread per process that reconnects."""

    def __init__(self, client: redis.Redis, prefix: str = "tracon") -> None:
        self.client = client
        self.channel = f"{prefix}:cancel"
        self._listeners: list[Listener] = []
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stopped = threading.Event()
        self.subscribed = threading.Event()

    def stop(self) -> None:
        self._stopped.set()

    def publish(self, run_id: str) -> None:
        try:
            self.client.publish(self.channel, run_id)
        except redis.RedisError as exc:
            log.warning("cancel notice for %s not sent (workers poll SQL): %s", run_id, exc)

    def subscribe(self, listener: Listener) -> None:
        with self._lock:
            self._listeners.append(listener)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._listen_forever, daemon=True, name="cancel-listener"
                )
                self._thread.start()

    def _listen_forever(self) -> None:
        while not self._stopped.is_set():
            try:
                self._listen()
            except Exception as exc:  # a lost connection: SQL polling covers the gap
                self.subscribed.clear()
                if not self._stopped.is_set():
                    log.warning("cancel listener lost Redis, reconnecting: %s", exc)
                self._stopped.wait(1.0)

    def _listen(self) -> None:
        pubsub = self.client.pubsub(ignore_subscribe_messages=True)
        try:
            pubsub.subscribe(self.channel)
            self.subscribed.set()
            while not self._stopped.is_set():
                message = pubsub.get_message(timeout=1.0)
                if message is not None and message.get("type") == "message":
                    self._deliver(_text(message["data"]))
        finally:
            with contextlib.suppress(Exception):
                pubsub.close()

    def _deliver(self, run_id: str) -> None:
        with self._lock:
            listeners = list(self._listeners)
        for listener in listeners:
            listener(run_id)


class MemoryCancelBus:
    """Synchronous delivery inside one process."""

    def __init__(self) -> None:
        self._listeners: list[Listener] = []

    def publish(self, run_id: str) -> None:
        for listener in list(self._listeners):
            listener(run_id)

    def subscribe(self, listener: Listener) -> None:
        self._listeners.append(listener)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
