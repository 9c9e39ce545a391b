"""What the SDK-backed providers (`openai`, `anthropic`) share: the call on the caller's
thread through the client's `post`, on abortable connections, with SDK errors mapped to
`ProviderError`; and the client itself, one per process (`PerProcess`: a forked child builds
its own), built on first use and shared by its threads.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar, Protocol

import httpx2

from tracon_jobs.abort import AbortSignal
from tracon_jobs.errors import ProviderError
from tracon_jobs.per_process import PerProcess
from tracon_jobs.providers.abortable_http import abortable
from tracon_jobs.providers.base import ModelRequest, ModelResponse, OnText
from tracon_jobs.providers.rate_headers import exhausted_for
from tracon_jobs.providers.wire import cancelled, malformed


class StreamReader(Protocol):
    """An answer assembled from its server-sent event lines."""

    def line(self, line: str) -> bool:
        """Read one line; True once the stream's end marker was read."""
        ...

    def result(self) -> ModelResponse:
        """The answer; a broken one (no end marker) is `kind="connection"`."""
        ...


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
        stream: bool = True,
        idle_timeout_seconds: float | None = None,
    ) -> None:
        self.name = name
        self.streams = stream
        self._idle_timeout_seconds = idle_timeout_seconds or timeout_seconds
        self._base_url = base_url or None
        self._api_key = api_key or self.placeholder_api_key
        self._timeout_seconds = timeout_seconds
        self._client: PerProcess[Any] = PerProcess(self._new_client)

    def complete(self, request: ModelRequest, signal: AbortSignal) -> ModelResponse:
        """One call; `ProviderError(kind="cancelled")` when `signal` fired first."""
        if signal.aborted:
            raise cancelled(self.name, signal)
        arguments = self._arguments(request)
        client = self._client.get()
        try:
            with abortable(signal):
                raw = client.post(self.path, body=arguments, cast_to=httpx2.Response)
                body = raw.content
        except self.sdk_error as exc:
            if signal.aborted:
                raise cancelled(self.name, signal) from None
            raise self._map_error(exc) from exc
        return with_provider_wait(self._to_response(body, request), raw.headers)

    def stream(self, request: ModelRequest, signal: AbortSignal, on_text: OnText) -> ModelResponse:
        """One call read as it arrives: `on_text` gets each piece of text, and the answer is
        the one `complete` would return. A wait between chunks longer than the read timeout, or
        a whole call longer than the timeout, fails with `kind="timeout"`; a stream cut before
        its end marker is a broken answer (`kind="connection"`)."""
        if signal.aborted:
            raise cancelled(self.name, signal)
        arguments = {**self._arguments(request), **self._stream_arguments()}
        reader = self._stream_reader(request, on_text)
        client = self._client.get()
        call = signal.child(self._timeout_seconds)  # the whole call's deadline
        try:
            with abortable(call):
                response = client.post(
                    self.path,
                    body=arguments,
                    cast_to=httpx2.Response,
                    stream=True,
                    options={"timeout": self._stream_timeout()},
                )
                try:
                    lines = response.iter_lines()
                    for line in lines:
                        if reader.line(line):
                            _read_to_the_end(lines, call)
                            break
                finally:
                    response.close()
        except (self.sdk_error, httpx2.HTTPError) as exc:
            if signal.aborted:
                raise cancelled(self.name, signal) from None
            if call.aborted or isinstance(exc, httpx2.TimeoutException):
                raise self._timeout() from None
            if isinstance(exc, self.sdk_error):
                raise self._map_error(exc) from exc
            raise malformed(self.name, f"a stream cut short ({exc!r})") from None
        finally:
            call.abort("done")  # its deadline and its link to the run's signal go
        if signal.aborted:
            raise cancelled(self.name, signal)
        if call.reason == "timeout":
            raise self._timeout()
        return with_provider_wait(reader.result(), response.headers)

    def _stream_timeout(self) -> httpx2.Timeout:
        """Each wait (connecting, each chunk) ends at the idle timeout; the timer set to
        `TimeoutSeconds` ends the whole call."""
        return httpx2.Timeout(self._idle_timeout_seconds)

    def _timeout(self) -> ProviderError:
        return ProviderError(
            f"Provider '{self.name}' timed out (stream longer than {self._timeout_seconds:g} s)",
            provider=self.name,
            kind="timeout",
        )

    def close(self) -> None:
        """Close this process's client and its connections."""
        self._client.close()

    def _stream_arguments(self) -> dict[str, Any]:
        return {"stream": True}

    def _stream_reader(self, request: ModelRequest, on_text: OnText) -> StreamReader:
        raise NotImplementedError

    def _new_client(self) -> Any:
        raise NotImplementedError

    def _arguments(self, request: ModelRequest) -> dict[str, Any]:
        raise NotImplementedError

    def _map_error(self, exc: Exception) -> ProviderError:
        raise NotImplementedError

    def _to_response(self, body: bytes, request: ModelRequest) -> ModelResponse:
        raise NotImplementedError


TAIL_SECONDS = 0.5
"""How long the end of a stream's body may take after its last event."""


def _read_to_the_end(lines: Iterator[str], call: AbortSignal) -> None:
    """Read what follows a stream's last event (normally the body's end, in the same
    packet), so its connection goes back to the pool instead of being closed; a server
    that keeps the body open costs `TAIL_SECONDS`, not a failed call."""
    tail = call.child(TAIL_SECONDS)
    try:
        with abortable(tail):
            for _ in lines:
                pass
    except Exception:  # the answer is whole already; the connection is not reused
        pass
    finally:
        tail.abort("done")


def with_provider_wait(answer: ModelResponse, headers: Mapping[str, str]) -> ModelResponse:
    """The answer, with the wait its rate-limit headers ask for when a limit is spent."""
    wait = exhausted_for(headers)
    return answer if wait is None else dataclasses.replace(answer, provider_wait=wait)
