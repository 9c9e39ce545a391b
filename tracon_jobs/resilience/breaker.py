"""The circuit breaker: one circuit per provider name, shared by every process.

    closed ──N consecutive counted failures──> open ──BreakDuration──> half_open
      ^                                          ^                       │
      └────────── probe succeeds ────────────────┼──── probe fails ──────┘

The transitions are a pure function (`transition`) of state, outcome and `now`; the Redis
store runs the same rules in Lua with Redis server time, so N failures spread over K
processes open the circuit at exactly N. Half-open admits `HalfOpenMaxProbes` probes, each
on a lease, so a prober that crashed or hangs never wedges the circuit.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Protocol

import redis

from tracon_jobs import metrics
from tracon_jobs.coordination.cluster import CoordinationClient, reads_at_server_time
from tracon_jobs.coordination.scripts import Scripts
from tracon_jobs.errors import ProviderUnavailableError

log = logging.getLogger(__name__)

State = Literal["closed", "open", "half_open"]
Outcome = Literal["success", "failure", "release"]


@dataclass(frozen=True)
class BreakerPolicy:
    threshold: int
    break_ms: int
    max_probes: int
    probe_lease_ms: int


@dataclass(frozen=True)
class Admission:
    allowed: bool
    probe: bool = False
    retry_after_ms: int = 0
    before: State = "closed"
    after: State = "closed"


@dataclass(frozen=True)
class Transition:
    before: State
    after: State
    failures: int = 0
    open_until_ms: int = 0

    @property
    def changed(self) -> bool:
        return self.before != self.after


@dataclass(frozen=True)
class CircuitSnapshot:
    provider: str
    state: State
    failures: int
    retry_after_ms: int
    probes: int


@dataclass(frozen=True)
class Circuit:
    """The stored state of one circuit (what the Redis hash holds)."""

    state: State = "closed"
    failures: int = 0
    open_until_ms: int = 0
    probes: dict[str, int] = field(default_factory=dict)  # token -> lease deadline


# -- the pure state machine ------------------------------------------------------------


def admit(
    circuit: Circuit, policy: BreakerPolicy, now: int, token: str
) -> tuple[Circuit, Admission]:
    if circuit.state == "closed":
        return circuit, Admission(True)
    if circuit.state == "open" and now < circuit.open_until_ms:
        return circuit, Admission(
            False, retry_after_ms=circuit.open_until_ms - now, before="open", after="open"
        )
    probes = {t: until for t, until in circuit.probes.items() if until > now}
    half = replace(circuit, state="half_open", probes=probes)
    if len(probes) < policy.max_probes:
        half = replace(half, probes={**probes, token: now + policy.probe_lease_ms})
        return half, Admission(True, probe=True, before=circuit.state, after="half_open")
    wait = max(min(probes.values()) - now, 1)
    return half, Admission(False, retry_after_ms=wait, before=circuit.state, after="half_open")


def transition(
    circuit: Circuit,
    policy: BreakerPolicy,
    now: int,
    token: str,
    outcome: Outcome,
    retry_after_ms: int = 0,
) -> tuple[Circuit, Transition]:
    state, is_probe = circuit.state, token in circuit.probes
    reopen = Circuit("open", circuit.failures, now + max(policy.break_ms, retry_after_ms))
    if outcome == "release":
        rest = {t: u for t, u in circuit.probes.items() if t != token}
        return replace(circuit, probes=rest), _same(circuit)
    if outcome == "success":
        if state == "closed" or (state == "half_open" and is_probe):
            return Circuit(), Transition(state, "closed")
        return circuit, _same(circuit)
    if state == "closed":
        failures = circuit.failures + 1
        if failures >= policy.threshold:
            opened = replace(reopen, failures=failures)
            return opened, Transition("closed", "open", failures, opened.open_until_ms)
        return replace(circuit, failures=failures), Transition("closed", "closed", failures)
    if state == "half_open" and is_probe:
        return reopen, Transition("half_open", "open", circuit.failures, reopen.open_until_ms)
    if state == "open" and retry_after_ms and now + retry_after_ms > circuit.open_until_ms:
        later = replace(circuit, open_until_ms=now + retry_after_ms)
        return later, _same(later)
    return circuit, _same(circuit)


def _same(circuit: Circuit) -> Transition:
    return Transition(circuit.state, circuit.state, circuit.failures, circuit.open_until_ms)


# -- stores ------------------------------------------------------------------------------


class BreakerStore(Protocol):
    def admit(self, provider: str, policy: BreakerPolicy, token: str) -> Admission: ...

    def admit_later(
        self, provider: str, policy: BreakerPolicy, token: str
    ) -> Callable[[], Admission]:
        """`admit` whose reply is read when the result is called (it may ride along with
        the store's next call)."""
        ...

    def record(
        self,
        provider: str,
        policy: BreakerPolicy,
        token: str,
        outcome: Outcome,
        retry_after_ms: int = 0,
    ) -> Transition: ...

    def note_success(self, provider: str, policy: BreakerPolicy, token: str) -> None:
        """`record` a success of a call that was no probe, without waiting for the reply:
        it never moves the state (a closed circuit only forgets its failures)."""
        ...

    def snapshot(self, provider: str) -> CircuitSnapshot: ...


class MemoryBreakerStore:
    """The same rules for one process; `clock` returns milliseconds (injectable)."""

    def __init__(self, clock: Callable[[], int] | None = None) -> None:
        self.clock = clock or (lambda: int(time.monotonic() * 1000))
        self._circuits: dict[str, Circuit] = {}
        self._lock = threading.Lock()

    def admit(self, provider: str, policy: BreakerPolicy, token: str) -> Admission:
        with self._lock:
            circuit = self._circuits.get(provider, Circuit())
            self._circuits[provider], admission = admit(circuit, policy, self.clock(), token)
            return admission

    def admit_later(
        self, provider: str, policy: BreakerPolicy, token: str
    ) -> Callable[[], Admission]:
        admission = self.admit(provider, policy, token)
        return lambda: admission

    def record(
        self,
        provider: str,
        policy: BreakerPolicy,
        token: str,
        outcome: Outcome,
        retry_after_ms: int = 0,
    ) -> Transition:
        with self._lock:
            circuit = self._circuits.get(provider, Circuit())
            now = self.clock()
            self._circuits[provider], change = transition(
                circuit, policy, now, token, outcome, retry_after_ms
            )
            return change

    def note_success(self, provider: str, policy: BreakerPolicy, token: str) -> None:
        self.record(provider, policy, token, "success")

    def snapshot(self, provider: str) -> CircuitSnapshot:
        with self._lock:
            circuit = self._circuits.get(provider, Circuit())
            return _snapshot(provider, circuit, self.clock())


Transitions = str | Callable[[str], str]
"""Where the breaker's script pushes a circuit's moves: a function of the provider giving its
own list, in the provider's hash slot (`webhooks.circuits.transitions_key`), or one list's key
for every provider (how earlier versions recorded them: a cluster refuses it)."""


class RedisBreakerStore:
    """Circuits in Redis, changed only by Lua scripts that read Redis server time.

    With `transitions`, the script that moves a circuit also pushes the move onto a list,
    atomically with it (`webhooks.circuits` turns them into messages)."""

    def __init__(
        self,
        client: CoordinationClient,
        prefix: str = "tracon",
        *,
        transitions: Transitions | None = None,
    ) -> None:
        self.client = client
        self.prefix = prefix
        self.transitions = transitions
        self.scripts = Scripts(client)

    def transitions_key(self, provider: str) -> str | None:
        """The list the provider's moves are pushed onto; None when none is."""
        if self.transitions is None or isinstance(self.transitions, str):
            return self.transitions
        return self.transitions(provider)

    def keys(self, provider: str) -> list[str]:
        base = f"{self.prefix}:breaker:{{{provider}}}"
        return [base, f"{base}:probes"]

    def admit(self, provider: str, policy: BreakerPolicy, token: str) -> Admission:
        return self.admit_later(provider, policy, token)()

    def admit_later(
        self, provider: str, policy: BreakerPolicy, token: str
    ) -> Callable[[], Admission]:
        args = [policy.max_probes, policy.probe_lease_ms, token]
        later = self.scripts.later("breaker_admit", self.keys(provider), args)

        def admission() -> Admission:
            allowed, probe, retry, before, after = later.reply()
            return Admission(bool(allowed), bool(probe), int(retry), _state(before), _state(after))

        return admission

    def record(
        self,
        provider: str,
        policy: BreakerPolicy,
        token: str,
        outcome: Outcome,
        retry_after_ms: int = 0,
    ) -> Transition:
        keys = self.keys(provider)
        args: list[str | int] = [outcome, token, policy.threshold, policy.break_ms, retry_after_ms]
        moves = self.transitions_key(provider)
        if moves is not None:
            keys.append(moves)
            args.append(provider)
        reply = self.scripts("breaker_record", keys, args)
        before, after, failures, open_until = reply
        return Transition(_state(before), _state(after), int(failures), int(open_until))

    def note_success(self, provider: str, policy: BreakerPolicy, token: str) -> None:
        args = ["success", token, policy.threshold, policy.break_ms, 0]
        self.scripts("breaker_record", self.keys(provider), args, reply=False)

    def snapshot(self, provider: str) -> CircuitSnapshot:
        key, probes_key = self.keys(provider)

        def reads(pipe: Any) -> None:
            pipe.hgetall(key)
            pipe.zrange(probes_key, 0, -1, withscores=True)

        (fields, probes), now = reads_at_server_time(self.client, key, reads)
        data = {_text(k): _text(v) for k, v in fields.items()}
        circuit = Circuit(
            state=_state(data.get("state", "closed")),
            failures=int(data.get("failures", 0)),
            open_until_ms=int(float(data.get("open_until", 0))),
            probes={_text(t): int(score) for t, score in probes},
        )
        return _snapshot(provider, circuit, now)


def _snapshot(provider: str, circuit: Circuit, now: int) -> CircuitSnapshot:
    state = circuit.state
    if state == "open" and now >= circuit.open_until_ms:
        state = "half_open"  # the break is over: the next call will probe
    live_probes = sum(1 for until in circuit.probes.values() if until > now)
    retry = max(circuit.open_until_ms - now, 0) if state == "open" else 0
    return CircuitSnapshot(provider, state, circuit.failures, retry, live_probes)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _state(value: bytes | str) -> State:
    text = _text(value)
    assert text in ("closed", "open", "half_open"), text
    return text  # type: ignore[return-value]


# -- the breaker the executor uses -------------------------------------------------------


@dataclass
class Ticket:
    """One admitted fallback link's loop: at most one success and one failure recorded."""

    provider: str
    token: str
    probe: bool
    tracked: bool  # False when disabled or the store was unreachable: record nothing
    change: Admission | None = None  # the admission moved the circuit (open -> half_open)
    succeeded: bool = False
    failed: bool = False


class CircuitBreaker:
    """One circuit per provider, shared by the cluster: admit, record, release (one script each)."""

    def __init__(
        self,
        store: BreakerStore,
        policy: BreakerPolicy,
        *,
        enabled: bool = True,
        on_store_unavailable: str = "allow",
        on_transition: Callable[[str, Transition], None] | None = None,
    ) -> None:
        self.store = store
        self.policy = policy
        self.enabled = enabled
        self.reject_without_store = on_store_unavailable == "reject"
        self.on_transition = on_transition  # told of each move a record made (after it)

    def admit(self, provider: str) -> Ticket:
        """A ticket for the link's loop, or ProviderUnavailableError while open."""
        return self.admit_later(provider)()

    def admit_later(self, provider: str) -> Callable[[], Ticket]:
        """`admit`, sent with the store's next call (inside `coordination.scripts.deferring`:
        the executor's budget gate before the link's first model call) instead of a round
        trip of its own. Calling the result gives the ticket, or raises as `admit` does."""
        token = uuid.uuid4().hex
        if not self.enabled:
            untracked = Ticket(provider, token, probe=False, tracked=False)
            return lambda: untracked
        try:
            pending = self.store.admit_later(provider, self.policy, token)
        except redis.RedisError as exc:
            without = self._without_store(provider, token, exc)
            return lambda: without

        def ticket() -> Ticket:
            try:
                admission = pending()
            except redis.RedisError as exc:
                return self._without_store(provider, token, exc)
            return self._ticket(provider, token, admission)

        return ticket

    def _ticket(self, provider: str, token: str, admission: Admission) -> Ticket:
        changed = admission.before != admission.after
        if changed:
            log.warning("circuit %s: %s -> %s", provider, admission.before, admission.after)
            metrics.circuit_transition(provider, admission.before, admission.after)
        if not admission.allowed:
            raise ProviderUnavailableError(provider, retry_after=admission.retry_after_ms / 1000)
        return Ticket(provider, token, admission.probe, True, admission if changed else None)

    def success(self, ticket: Ticket) -> Transition | None:
        """Record the link's first successful response; the transition if the state moved."""
        if ticket.succeeded:
            return None
        ticket.succeeded = True
        if ticket.probe:  # the probe's success closes the circuit: its transition is reported
            return self._record(ticket, "success")
        if ticket.tracked:  # goes with the store's next call (`coordination.scripts.deferring`)
            try:
                self.store.note_success(ticket.provider, self.policy, ticket.token)
            except redis.RedisError as exc:
                log.warning(
                    "circuit store unreachable; success of %s not recorded: %s",
                    ticket.provider,
                    exc,
                )
        return None

    def failure(self, ticket: Ticket, retry_after: float | None = None) -> Transition | None:
        if ticket.failed:
            return None
        ticket.failed = True
        return self._record(ticket, "failure", int((retry_after or 0) * 1000))

    def release(self, ticket: Ticket) -> None:
        """The loop ended with no outcome to record (cancelled): free its probe lease."""
        if ticket.probe and not (ticket.succeeded or ticket.failed):
            self._record(ticket, "release")

    def snapshot(self, provider: str) -> CircuitSnapshot:
        return self.store.snapshot(provider)

    def _record(
        self, ticket: Ticket, outcome: Outcome, retry_after_ms: int = 0
    ) -> Transition | None:
        if not ticket.tracked:
            return None
        try:
            change = self.store.record(
                ticket.provider, self.policy, ticket.token, outcome, retry_after_ms
            )
        except redis.RedisError as exc:
            log.warning(
                "circuit store unreachable; %s of %s not recorded: %s",
                outcome,
                ticket.provider,
                exc,
            )
            return None
        if not change.changed:
            return None
        log.warning("circuit %s: %s -> %s", ticket.provider, change.before, change.after)
        metrics.circuit_transition(ticket.provider, change.before, change.after)
        if self.on_transition is not None:
            self.on_transition(ticket.provider, change)
        return change

    def _without_store(self, provider: str, token: str, exc: Exception) -> Ticket:
        if self.reject_without_store:
            log.error("circuit store unreachable; rejecting call to %s: %s", provider, exc)
            raise ProviderUnavailableError(provider, retry_after=None) from exc
        log.warning("circuit store unreachable; allowing call to %s: %s", provider, exc)
        return Ticket(provider, token, probe=False, tracked=False)
