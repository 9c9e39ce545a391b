"""Provider rate limits: requests and tokens a minute, across the cluster, exact.

A provider's `RequestsPerMinute` and `TokensPerMinute` (and a model's, under the provider's
`Models`) bound the calls that *start* in any 60-second window, on every worker together:
each start is recorded in Redis, in a sorted set by time, by one script that checks every
limit of the call and records it under all of them or none (`rate_admit.lua`). A call's
tokens are counted from what it may use (its input, estimated, and its `max_tokens`, or the
reservation a call without one makes) and corrected by its answer's usage.

The provider's own word lowers the allowance until its reset: a `429` with `Retry-After`, or
an answer saying no requests or tokens remain (OpenAI's `x-ratelimit-*` headers, Anthropic's
`anthropic-ratelimit-*`) keeps every worker's calls of that provider (and model) from
starting before then.

A call over a limit waits, bounded by its run's abort signal (a cancel, a drain deadline, a
takeover ends the wait at once). With no limit configured, nothing here costs a Redis call.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

import redis

from tracon_jobs import metrics
from tracon_jobs.abort import AbortSignal
from tracon_jobs.coordination.cluster import CoordinationClient
from tracon_jobs.coordination.scripts import Scripts
from tracon_jobs.errors import MustPark, ProviderError

log = logging.getLogger(__name__)

WINDOW_MS = 60_000
MAX_WAIT_SLICE = 1.0
"""Seconds a waiting call sleeps at most before it asks again (a limit freed early by a
correction, or a block lifted, is seen within it)."""


@dataclass(frozen=True)
class RateLimit:
    """Calls and tokens a window (None: no limit of that kind)."""

    requests: int | None = None
    tokens: int | None = None

    def as_args(self) -> list[int]:
        return [
            -1 if self.requests is None else self.requests,
            -1 if self.tokens is None else self.tokens,
        ]


@dataclass(frozen=True)
class Scope:
    """One limit a call is held to: the provider's, or one model's of the provider."""

    name: str  # "openai" or "openai/gpt-4o"
    limit: RateLimit


class RateStore(Protocol):
    def admit(
        self, scopes: list[Scope], call_id: str, tokens: int, window_ms: int
    ) -> tuple[int, int]:
        """(0, now ms) with the start recorded under every scope, or (ms to wait, now ms)
        with nothing recorded."""
        ...

    def correct(self, scopes: list[Scope], call_id: str, tokens: int) -> None:
        """The call's tokens as its answer counted them."""
        ...

    def block(self, scope: str, ms: int) -> None:
        """No call of `scope` starts for `ms` (a later block wins)."""
        ...

    def usage(self, scope: str, window_ms: int) -> tuple[int, int, int]:
        """(starts in the window, their tokens, ms the provider's word still holds)."""
        ...


@dataclass(frozen=True)
class RateUsage:
    """A limit's window now: what `GET /api/circuits` and `/metrics` show."""

    scope: str
    limit: RateLimit
    requests: int
    tokens: int
    blocked_seconds: float

    def as_json(self) -> dict[str, object]:
        return {
            "scope": self.scope,
            "requestsPerMinute": self.limit.requests,
            "requests": self.requests,
            "tokensPerMinute": self.limit.tokens,
            "tokens": self.tokens,
            "blockedFor": self.blocked_seconds or None,
        }


class RedisRateStore:
    def __init__(self, client: CoordinationClient, prefix: str = "tracon") -> None:
        self.scripts = Scripts(client)
        self.prefix = prefix

    def keys(self, scope: str) -> list[str]:
        """The scope's windows and block, hash-tagged with its provider (`openai` of
        `openai/gpt-4o` too): one admission checks the provider's and the model's scopes in
        one script, so their keys must share a Redis Cluster hash slot."""
        base = f"{self.prefix}:rate:{{{scope.partition('/')[0]}}}:{scope}"
        return [f"{base}:starts", f"{base}:tokens", f"{base}:blocked"]

    def admit(
        self, scopes: list[Scope], call_id: str, tokens: int, window_ms: int
    ) -> tuple[int, int]:
        keys = [key for scope in scopes for key in self.keys(scope.name)]
        args = [call_id, tokens, window_ms, *[a for s in scopes for a in s.limit.as_args()]]
        wait, now = self.scripts("rate_admit", keys, args)
        return int(wait), int(now)

    def correct(self, scopes: list[Scope], call_id: str, tokens: int) -> None:
        keys = [key for scope in scopes for key in self.keys(scope.name)[:2]]
        self.scripts("rate_correct", keys, [call_id, tokens], reply=False)

    def block(self, scope: str, ms: int) -> None:
        self.scripts("rate_block", [self.keys(scope)[2]], [ms])

    def usage(self, scope: str, window_ms: int) -> tuple[int, int, int]:
        starts, tokens, blocked = self.scripts("rate_usage", self.keys(scope), [window_ms])
        return int(starts), int(tokens), int(blocked)


@dataclass
class _Window:
    starts: dict[str, int] = field(default_factory=dict)  # call id -> start ms
    tokens: dict[str, int] = field(default_factory=dict)
    blocked_until: int = 0


class MemoryRateStore:
    """The same rules in one process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._windows: dict[str, _Window] = {}

    @staticmethod
    def _now() -> int:
        return int(time.monotonic() * 1000)

    def admit(
        self, scopes: list[Scope], call_id: str, tokens: int, window_ms: int
    ) -> tuple[int, int]:
        with self._lock:
            now = self._now()
            windows = [self._windows.setdefault(s.name, _Window()) for s in scopes]
            waits = [
                _wait_under(window, scope.limit, tokens, now, window_ms)
                for window, scope in zip(windows, scopes, strict=True)
            ]
            wait = max(waits, default=0)
            if wait > 0:
                return wait, now
            for window in windows:
                window.starts[call_id] = now
                window.tokens[call_id] = tokens
            return 0, now

    def correct(self, scopes: list[Scope], call_id: str, tokens: int) -> None:
        with self._lock:
            for scope in scopes:
                window = self._windows.get(scope.name)
                if window is not None and call_id in window.starts:
                    window.tokens[call_id] = tokens

    def block(self, scope: str, ms: int) -> None:
        with self._lock:
            window = self._windows.setdefault(scope, _Window())
            window.blocked_until = max(window.blocked_until, self._now() + ms)

    def usage(self, scope: str, window_ms: int) -> tuple[int, int, int]:
        with self._lock:
            window = self._windows.setdefault(scope, _Window())
            now = self._now()
            _prune(window, now, window_ms)
            blocked = max(window.blocked_until - now, 0)
            return len(window.starts), sum(window.tokens.values()), blocked


def _prune(window: _Window, now: int, window_ms: int) -> None:
    """Drop the starts that left the window."""
    for call_id, at in list(window.starts.items()):
        if at <= now - window_ms:
            del window.starts[call_id]
            window.tokens.pop(call_id, None)


def _wait_under(window: _Window, limit: RateLimit, need: int, now: int, window_ms: int) -> int:
    """What rate_admit.lua computes for one scope."""
    if window.blocked_until > now:
        return window.blocked_until - now
    _prune(window, now, window_ms)
    order = sorted(window.starts.items(), key=lambda item: item[1])
    count = len(order)
    if limit.requests is not None and count >= limit.requests:
        if limit.requests == 0:
            return window_ms
        return max(order[count - limit.requests][1] + window_ms - now, 1)
    if limit.tokens is not None and count:
        room = sum(window.tokens.values()) + need - limit.tokens
        if room > 0:
            for index, (call_id, at) in enumerate(order):
                room -= window.tokens.get(call_id, 0)
                if room <= 0 or index == count - 1:
                    return max(at + window_ms - now, 1)
    return 0


@dataclass(frozen=True)
class Admitted:
    """A started call's record under its scopes (empty: the provider has no limit)."""

    scopes: list[Scope]
    call_id: str = ""


NOT_LIMITED = Admitted([])


class _Limited(Protocol):
    @property
    def requests_per_minute(self) -> int | None: ...

    @property
    def tokens_per_minute(self) -> int | None: ...


class _LimitedProvider(_Limited, Protocol):
    @property
    def models(self) -> Mapping[str, _Limited]: ...


def limits_of(providers: Mapping[str, _LimitedProvider]) -> dict[str, RateLimit]:
    """The configured limits by scope: `<provider>` and `<provider>/<model>`."""
    found: dict[str, RateLimit] = {}
    for name, provider in providers.items():
        scopes: list[tuple[str, _Limited]] = [(name, provider)]
        scopes += [(f"{name}/{model}", limits) for model, limits in provider.models.items()]
        for scope_name, limited in scopes:
            limit = RateLimit(limited.requests_per_minute, limited.tokens_per_minute)
            if limit.requests is not None or limit.tokens is not None:
                found[scope_name] = limit
    return found


class RateLimits:
    """What the executor uses: `admitted = limits.admit(provider, model, tokens, signal)`
    before a call starts, `limits.used(admitted, tokens)` with its answer, and
    `limits.learn(provider, model, seconds)` when the provider said to wait."""

    def __init__(
        self,
        store: RateStore,
        limits: Mapping[str, RateLimit],
        window_ms: int = WINDOW_MS,
    ) -> None:
        self.store = store
        self.limits = dict(limits)  # scope name -> limit
        self.window_ms = window_ms

    def scopes(self, provider: str, model: str) -> list[Scope]:
        found = []
        for name in (provider, f"{provider}/{model}"):
            limit = self.limits.get(name)
            if limit is not None:
                found.append(Scope(name, limit))
        return found

    def admit(
        self,
        provider: str,
        model: str,
        tokens: int,
        signal: AbortSignal,
        park_after: float | None = None,
    ) -> Admitted:
        """Wait until the call may start; `MustPark` when it would wait longer than
        `park_after` seconds (nothing is recorded then)."""
        scopes = self.scopes(provider, model)
        if not scopes:
            return NOT_LIMITED
        call_id = uuid.uuid4().hex
        started = time.monotonic()
        waited = False
        while True:
            try:
                wait_ms, _ = self.store.admit(scopes, call_id, tokens, self.window_ms)
            except redis.RedisError as exc:
                log.warning("rate limit store unreachable; calling %s unlimited: %s", provider, exc)
                return NOT_LIMITED
            if wait_ms <= 0:
                metrics.rate_limit_wait(provider, time.monotonic() - started, waited)
                return Admitted(scopes, call_id)
            if park_after is not None and wait_ms / 1000 > park_after:
                metrics.rate_limit_wait(provider, time.monotonic() - started, waited)
                raise MustPark("rate_limit", wait_ms / 1000)
            waited = True
            if signal.wait(min(wait_ms / 1000, MAX_WAIT_SLICE)):
                metrics.rate_limit_wait(provider, time.monotonic() - started, waited)
                raise ProviderError(
                    f"cancelled while waiting for '{provider}' rate limits ({signal.reason})",
                    provider=provider,
                    kind="cancelled",
                )

    def usage(self, provider: str) -> list[RateUsage]:
        """The provider's limits now (its own, then its models'); RedisError propagates."""
        found = []
        for name, limit in sorted(self.limits.items()):
            if name == provider or name.startswith(f"{provider}/"):
                requests, tokens, blocked = self.store.usage(name, self.window_ms)
                found.append(RateUsage(name, limit, requests, tokens, blocked / 1000))
        return found

    def used(self, admitted: Admitted, tokens: int) -> None:
        if not admitted.scopes:
            return
        try:
            self.store.correct(admitted.scopes, admitted.call_id, tokens)
        except redis.RedisError as exc:  # the reservation stands: the limit errs on the safe side
            log.warning("rate limit correction lost: %s", exc)

    def learn(self, provider: str, model: str, seconds: float | None) -> None:
        """The provider said to wait `seconds`: no call of its limited scopes starts sooner."""
        if seconds is None or seconds <= 0:
            return
        for scope in self.scopes(provider, model):
            try:
                self.store.block(scope.name, int(seconds * 1000) + 1)
            except redis.RedisError as exc:
                log.warning("rate limit of %s not lowered: %s", scope.name, exc)
