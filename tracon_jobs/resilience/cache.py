"""Response caching: an identical model request answered from the cluster's cache.

The key is the exact request (provider, model, messages, tools and options) hashed, so a
hit is only ever the answer to the same question. The executor looks it up inside the
tool-call loop, after the link's circuit admitted the loop: an open circuit still blocks a
call even when its answer is cached (the reliability guide's rule for caching and the
breaker). A store that cannot be reached is a miss, never an error.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from typing import Any, Protocol

import redis

from tracon_jobs.coordination.cluster import CoordinationClient
from tracon_jobs.coordination.scripts import Scripts
from tracon_jobs.providers.base import ModelRequest, ModelResponse, ToolCall, Usage

log = logging.getLogger(__name__)


class ResponseCache(Protocol):
    def get(self, agent: str, key: str) -> dict[str, Any] | None: ...

    def put(
        self, agent: str, key: str, value: dict[str, Any], ttl_ms: int, max_entries: int
    ) -> None: ...


def request_key(provider: str, request: ModelRequest) -> str:
    """The hash of everything that decides the answer."""
    shape: dict[str, Any] = {
        "provider": provider,
        "model": request.model,
        "messages": request.messages,
        "tools": request.tools,
        "temperature": request.temperature,
        "topP": request.top_p,
        "maxOutputTokens": request.max_output_tokens,
        "responseFormat": request.response_format,
    }
    # a run's own options, each only when set: a request without them keeps its key
    own = {
        "stop": request.stop or None,
        "seed": request.seed,
        "presencePenalty": request.presence_penalty,
        "frequencyPenalty": request.frequency_penalty,
        "logitBias": request.logit_bias or None,
        "reasoningEffort": request.reasoning_effort,
        "verbosity": request.verbosity,
    }
    shape.update({name: value for name, value in own.items() if value is not None})
    canonical = json.dumps(shape, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()


def response_to_json(response: ModelResponse) -> dict[str, Any]:
    return {
        "model": response.model,
        "text": response.text,
        "toolCalls": [[c.id, c.name, c.arguments] for c in response.tool_calls],
        "finishReason": response.finish_reason,
    }


def response_from_json(value: dict[str, Any]) -> ModelResponse:
    """A cached answer: what the provider said, with no usage (nothing was spent)."""
    return ModelResponse(
        model=str(value["model"]),
        text=value.get("text"),
        tool_calls=[ToolCall(str(i), str(n), str(a)) for i, n, a in value.get("toolCalls", [])],
        usage=Usage(0, 0),
        finish_reason=str(value.get("finishReason") or "stop"),
    )


class RedisResponseCache:
    """Entries as keys with a TTL, an index per agent bounding how many are kept."""

    def __init__(self, client: CoordinationClient, prefix: str = "tracon") -> None:
        self.client = client
        self.scripts = Scripts(client)
        self.prefix = prefix

    def _entry(self, agent: str, key: str) -> str:
        return f"{self.prefix}:cache:{{{agent}}}:{key}"

    def _index(self, agent: str) -> str:
        return f"{self.prefix}:cache:{{{agent}}}"

    def get(self, agent: str, key: str) -> dict[str, Any] | None:
        try:
            raw = self.client.get(self._entry(agent, key))
        except redis.RedisError as exc:
            log.warning("response cache unreachable; a miss: %s", exc)
            return None
        return None if raw is None else dict(json.loads(raw))

    def put(
        self, agent: str, key: str, value: dict[str, Any], ttl_ms: int, max_entries: int
    ) -> None:
        keys = [self._entry(agent, key), self._index(agent)]
        try:
            self.scripts("cache_put", keys, [json.dumps(value), ttl_ms, max_entries])
        except redis.RedisError as exc:
            log.warning("response cache unreachable; response not cached: %s", exc)


class MemoryResponseCache:
    """The same rules in one process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[str, dict[str, tuple[float, dict[str, Any]]]] = {}

    def get(self, agent: str, key: str) -> dict[str, Any] | None:
        with self._lock:
            found = self._entries.get(agent, {}).get(key)
            if found is None or found[0] <= time.monotonic():
                return None
            return found[1]

    def put(
        self, agent: str, key: str, value: dict[str, Any], ttl_ms: int, max_entries: int
    ) -> None:
        with self._lock:
            entries = self._entries.setdefault(agent, {})
            now = time.monotonic()
            for stale in [k for k, (expires, _v) in entries.items() if expires <= now]:
                del entries[stale]
            entries.pop(key, None)
            entries[key] = (now + ttl_ms / 1000, value)
            while len(entries) > max_entries:
                del entries[next(iter(entries))]  # insertion order: the oldest first
