"""What the SDK-backed providers (`openai`, `anthropic`) share: the call on the caller's
thread through the client's `post`, on abortable connections, with SDK errors mapped to
`ProviderError`; and the client itself, one per process, built on first use and shared by its
threads. A forked child builds its own, because the connections in its copy of the parent's
pool belong to the parent: two processes reading one socket would take each other's answers.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any, ClassVar, Generic, Protocol, TypeVar

from tracon_jobs.abort import AbortSignal
from tracon_jobs.errors import ProviderError
from tracon_jobs.providers.abortable_http import abortable
from tracon_jobs.providers.base import ModelRequest, ModelResponse
from tracon_jobs.providers.wire import cancelled


class Closable(Protocol):
    def close(self) -> None: ...


C = TypeVar("C", bound=Closable)

_build_lock = threading.Lock()


def _new_lock_after_fork() -> None:
    """A lock held by another thread at the fork stays held in the child: replace it."""
    global _build_lock
    _build_lock = threading.Lock()


os.register_at_fork(after_in_child=_new_lock_after_fork)


class ProcessClient(Generic[C]):
    """The client `build` makes, once in each process that asks for it."""

    def __init__(self, build: Callable[[], C]) -> None:
        self._build = build
        self._client: C | None = None
        self._pid: int | None = None

    def get(self) -> C:
        client = self._client
        if client is not None and self._pid == os.getpid():
            return client
        with _build_lock:
            client = self._client
            if client is None or self._pid != os.getpid():
                client = self._build()
                self._client, self._pid = client, os.getpid()
            return client

    def close(self) -> None:
        """Close this process's client and its connections (a forked child's are its parent's)."""
        client, self._client = self._client, None
        if client is not None and self._pid == os.getpid():
            client.close()


class SdkProvider:
    """One endpoint of an SDK whose client has `post(path, body=..., cast_to=bytes)` (both
    SDKs' own path under their typed methods, without the transform of the arguments), shared
    by every thread of the process. Subclasses say which path, which errors and how a request
    and an answer are translated."""

    path: ClassVar[str]
    sdk_error: ClassVar[type[Exception]]
    placeholder_api_key: ClassVar[str] = "not-needed"  # local servers ignore the key; SDKs don't

    def __init__(
        self,
        name: str,
        *,
        base_url: str | None,
        api_key: str | None,
        timeout_seconds: float,
    ) -> None:
        self.name = name
        self._base_url = base_url or None
        self._api_key = api_key or self.placeholder_api_key
        self._timeout_seconds = timeout_seconds
        self._client: ProcessClient[Any] = ProcessClient(self._new_client)

    def complete(self, request: ModelRequest, signal: AbortSignal) -> ModelResponse:
        """One call; `ProviderError(kind="cancelled")` when `signal` fired first."""
        if signal.aborted:
            raise cancelled(self.name, signal)
        arguments = self._arguments(request)
        client = self._client.get()
        try:
            with abortable(signal):
                body = client.post(self.path, body=arguments, cast_to=bytes)
        except self.sdk_error as exc:
            if signal.aborted:
                raise cancelled(self.name, signal) from None
            raise self._map_error(exc) from exc
        return self._to_response(body, request)

    def close(self) -> None:
        """Close this process's client and its connections."""
        self._client.close()

    def _new_client(self) -> Any:
        raise NotImplementedError

    def _arguments(self, request: ModelRequest) -> dict[str, Any]:
        raise NotImplementedError

    def _map_error(self, exc: Exception) -> ProviderError:
        raise NotImplementedError

    def _to_response(self, body: bytes, request: ModelRequest) -> ModelResponse:
        raise NotImplementedError
