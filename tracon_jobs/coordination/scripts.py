"""Lua scripts shipped in `lua/`, loaded once per client and called by SHA.

Calls whose reply nobody waits for (a spend) may be deferred inside `deferring()`: they
run, in order, in one `EVALSHA` with the next call on the same client that needs its
reply, or when the block ends. A call whose reply is wanted a little later (`later`: a
circuit's admission, read after the budget gate that follows it) goes the same way. The
scripts are composed into one program, each body a function of its own `KEYS` and `ARGV`,
so each keeps its own semantics and the whole runs atomically.

Every script's own keys share one Redis Cluster hash slot: each store tags its keys with
the one thing they belong to (`tracon:budget:{<root run>}`, `tracon:breaker:{<provider>}`),
and `tests/unit/test_key_slots.py` checks every call site. Composed calls of several stores
do not (a circuit's record and a tree's spend): on a `RedisCluster` client the calls are cut,
in order, into runs of one slot each (`slot_runs`), one EVALSHA a run, so a composed call is
atomic within its slot only; on one server (or a Sentinel group's master) they go in one
EVALSHA as before (docs/reliability.md, "Redis Cluster").
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import redis
from redis.cluster import RedisCluster
from redis.crc import key_slot
from redis.exceptions import NoScriptError

from tracon_jobs.coordination.connections import command

log = logging.getLogger(__name__)

LUA = Path(__file__).with_name("lua")


@cache
def source(name: str) -> str:
    return (LUA / f"{name}.lua").read_text()


@cache
def composed_source(names: tuple[str, ...]) -> str:
    """One program running the named scripts in order; it returns their replies.

    ARGV opens with each script's key and argument counts; a script's `nil` or `false`
    reply comes back as `false` (a nil reply), so the table keeps its length.
    """
    parts = [f"-- composed: {' + '.join(names)}", "local scripts = {}"]
    for i, name in enumerate(names, 1):
        parts.append(f"scripts[{i}] = function(KEYS, ARGV)\n{source(name)}\nend")
    parts.append(
        "local function slice(t, from, count)\n"
        "  local out = {}\n"
        "  for i = 1, count do out[i] = t[from + i - 1] end\n"
        "  return out\n"
        "end\n"
        "local replies = {}\n"
        "local key_at, arg_at = 1, 2 * #scripts + 1\n"
        "for i = 1, #scripts do\n"
        "  local nkeys, nargs = tonumber(ARGV[2 * i - 1]), tonumber(ARGV[2 * i])\n"
        "  local reply = scripts[i](slice(KEYS, key_at, nkeys), slice(ARGV, arg_at, nargs))\n"
        "  if reply == nil then reply = false end\n"
        "  replies[i] = reply\n"
        "  key_at, arg_at = key_at + nkeys, arg_at + nargs\n"
        "end\n"
        "return replies"
    )
    return "\n".join(parts)


def slot_of(key: str | bytes) -> int:
    """The Redis Cluster hash slot of `key` (its `{tag}` when it has one), as the cluster and
    redis-py compute it."""
    return key_slot(key.encode() if isinstance(key, str) else key)


@dataclass
class Later:
    """The reply of a call sent with the next call on its client (`Scripts.later`)."""

    owner: Scripts
    done: bool = False
    value: Any = None
    error: BaseException | None = None

    def reply(self) -> Any:
        """The call's reply, sending it (with whatever waits on its client) if still queued."""
        if not self.done:
            self.owner.run_all(self.owner._take_deferred())
        if self.error is not None:
            raise self.error
        return self.value

    def settle(self, value: Any = None, error: BaseException | None = None) -> None:
        self.done, self.value, self.error = True, value, error


@dataclass(frozen=True)
class Call:
    name: str
    keys: list[str]
    args: list[Any]
    later: Later | None = None  # who waits for the reply of a call sent with a later one


class _Deferred(threading.local):
    def __init__(self) -> None:
        self.depth = 0
        self.calls: list[tuple[Scripts, Call]] = []


_deferred = _Deferred()

SPANS_SLOTS = -1
"""`slot_runs`' mark of a run opened by a call whose own keys span slots: nothing joins it."""


def slot_runs(calls: Sequence[Call]) -> list[list[Call]]:
    """`calls`, in order, cut into runs whose keys share one hash slot (a call with no keys
    joins the run before it): what one EVALSHA may carry on a Redis Cluster."""
    runs: list[list[Call]] = []
    current: int | None = None  # the open run's slot; None: no keys yet
    for call in calls:
        slots = {slot_of(key) for key in call.keys}
        one = next(iter(slots)) if len(slots) == 1 else None
        if runs and (not slots or (one is not None and current in (None, one))):
            runs[-1].append(call)
            current = current if one is None else one
        else:
            runs.append([call])
            current = one if one is not None else (SPANS_SLOTS if slots else None)
    return runs


@contextmanager
def deferring() -> Iterator[None]:
    """Calls made with `reply=False` in this block (this thread) wait for the next call on
    their client, or for the block's end, and run with it in one round trip."""
    _deferred.depth += 1
    try:
        yield
    finally:
        _deferred.depth -= 1
        if _deferred.depth == 0:
            _flush_all()


def _flush_all() -> None:
    while _deferred.calls:
        owner = _deferred.calls[0][0]
        try:
            owner.run_all(owner._take_deferred())
        except redis.RedisError as exc:  # as each call alone would have been: not counted
            log.warning("Redis unreachable; deferred scripts not run: %s", exc)


class Script:
    """A Lua script called by its SHA on the calling thread's connection (`command`),
    loaded into the server when it does not know it yet (a restart flushed its cache)."""

    __slots__ = ("client", "sha", "text")

    def __init__(self, client: redis.Redis | RedisCluster, text: str) -> None:
        self.client = client
        self.text = text
        self.sha = hashlib.sha1(text.encode()).hexdigest()

    def __call__(self, keys: Sequence[Any], args: Sequence[Any]) -> Any:
        try:
            return self._evalsha(keys, args)
        except NoScriptError:
            self.client.script_load(self.text)  # a cluster loads it on every master
            return self._evalsha(keys, args)

    def _evalsha(self, keys: Sequence[Any], args: Sequence[Any]) -> Any:
        if isinstance(self.client, RedisCluster):  # routed by its keys' slot (one, or refused)
            return self.client.execute_command("EVALSHA", self.sha, len(keys), *keys, *args)
        return command(self.client, "EVALSHA", self.sha, len(keys), *keys, *args)


class Scripts:
    """Registered scripts of one Redis client: one round trip per call (EVALSHA)."""

    def __init__(self, client: redis.Redis | RedisCluster) -> None:
        self.client = client
        self.cluster = isinstance(client, RedisCluster)
        self._scripts: dict[str, Script] = {}

    def __call__(self, name: str, keys: list[str], args: list[Any], *, reply: bool = True) -> Any:
        """The script's reply; None for a call deferred (`reply=False` inside `deferring`)."""
        call = Call(name, keys, args)
        if not reply and _deferred.depth:
            _deferred.calls.append((self, call))
            return None
        if _deferred.calls:
            pending = self._take_deferred()
            if pending:
                try:
                    return self.run_all([*pending, call])[-1]
                except redis.RedisError as exc:  # the caller handles its own call's failure
                    names = ", ".join(deferred.name for deferred in pending)
                    log.warning("Redis unreachable; deferred scripts not run (%s): %s", names, exc)
                    raise
        return self._script(name, (name,))(keys, args)

    def later(self, name: str, keys: list[str], args: list[Any]) -> Later:
        """A call whose reply is wanted but not yet: inside `deferring` it goes with the
        next call on this client, or when `reply()` is first asked for; else at once."""
        later = Later(self)
        call = Call(name, keys, args, later)
        if _deferred.depth:
            _deferred.calls.append((self, call))
        else:
            self.run_all([call])
        return later

    def run_all(self, calls: Sequence[Call]) -> list[Any]:
        """Several scripts in one EVALSHA, atomically and in order: each one's reply (and
        to each call sent for a `Later`, its own)."""
        try:
            replies = self._run_all(calls)
        except BaseException as exc:
            for call in calls:
                if call.later is not None:
                    call.later.settle(error=exc)
            raise
        for call, reply in zip(calls, replies, strict=True):
            if call.later is not None:
                call.later.settle(reply)
        return replies

    def _run_all(self, calls: Sequence[Call]) -> list[Any]:
        if len(calls) == 1:
            only = calls[0]
            return [self._script(only.name, (only.name,))(only.keys, only.args)]
        if self.cluster:
            runs = slot_runs(calls)
            if len(runs) > 1:  # one EVALSHA a slot, in order (the module's docstring)
                return [reply for run in runs for reply in self._run_all(run)]
        names = tuple(call.name for call in calls)
        counts = [n for call in calls for n in (len(call.keys), len(call.args))]
        keys = [key for call in calls for key in call.keys]
        args = [*counts, *(arg for call in calls for arg in call.args)]
        return list(self._script("+".join(names), names)(keys, args))

    def _take_deferred(self) -> list[Call]:
        """The deferred calls on this client, in order; the others stay queued."""
        mine = [call for owner, call in _deferred.calls if owner.client is self.client]
        _deferred.calls[:] = [(o, c) for o, c in _deferred.calls if o.client is not self.client]
        return mine

    def _script(self, key: str, names: tuple[str, ...]) -> Script:
        script = self._scripts.get(key)
        if script is None:
            text = source(names[0]) if len(names) == 1 else composed_source(names)
            script = self._scripts[key] = Script(self.client, text)
        return script
