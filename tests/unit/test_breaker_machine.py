"""The breaker's pure state machine: `admit` and `transition` with explicit `now` values."""

from __future__ import annotations

from dataclasses import replace

from tracon_jobs.resilience.breaker import (
    Admission,
    BreakerPolicy,
    Circuit,
    Outcome,
    admit,
    transition,
)

POLICY = BreakerPolicy(threshold=3, break_ms=1_000, max_probes=1, probe_lease_ms=500)
T0 = 1_000_000


def record(
    circuit: Circuit,
    now: int,
    outcome: Outcome = "failure",
    token: str = "caller",
    retry_after_ms: int = 0,
    policy: BreakerPolicy = POLICY,
) -> Circuit:
    after, _change = transition(circuit, policy, now, token, outcome, retry_after_ms)
    return after


def opened_at(now: int, policy: BreakerPolicy = POLICY) -> Circuit:
    """A circuit that `threshold` failures opened at `now`."""
    circuit = Circuit()
    for _ in range(policy.threshold):
        circuit = record(circuit, now, policy=policy)
    assert circuit.state == "open"
    return circuit


def probing(token: str = "probe", policy: BreakerPolicy = POLICY) -> tuple[Circuit, int]:
    """A half-open circuit with one admitted probe, and the time it was admitted."""
    now = T0 + policy.break_ms
    circuit, admission = admit(opened_at(T0, policy), policy, now, token)
    assert admission.allowed and admission.probe
    return circuit, now


def test_closed_admits_without_a_probe() -> None:
    circuit, admission = admit(Circuit(), POLICY, T0, "a")
    assert admission == Admission(True, probe=False, before="closed", after="closed")
    assert circuit == Circuit()


def test_opens_at_exactly_the_threshold() -> None:
    circuit = Circuit()
    for expected_failures in range(1, POLICY.threshold):
        circuit, change = transition(circuit, POLICY, T0, "a", "failure")
        assert (change.before, change.after, change.failures) == (
            "closed",
            "closed",
            expected_failures,
        )
    circuit, change = transition(circuit, POLICY, T0, "a", "failure")
    assert (change.before, change.after, change.changed) == ("closed", "open", True)
    assert change.failures == POLICY.threshold
    assert change.open_until_ms == T0 + POLICY.break_ms
    assert circuit.state == "open"


def test_threshold_of_one_opens_on_the_first_failure() -> None:
    policy = replace(POLICY, threshold=1)
    _circuit, change = transition(Circuit(), policy, T0, "a", "failure")
    assert (change.before, change.after) == ("closed", "open")


def test_success_resets_the_count() -> None:
    # Given threshold - 1 failures, then a success
    circuit = Circuit()
    for _ in range(POLICY.threshold - 1):
        circuit = record(circuit, T0)
    circuit, change = transition(circuit, POLICY, T0, "a", "success")
    assert change.failures == 0 and circuit.failures == 0
    # When threshold - 1 more failures arrive, Then the circuit is still closed
    for _ in range(POLICY.threshold - 1):
        circuit = record(circuit, T0)
    assert circuit.state == "closed"
    assert circuit.failures == POLICY.threshold - 1


def test_open_rejects_with_the_remaining_break() -> None:
    circuit = opened_at(T0)
    for elapsed in (0, 1, 400, POLICY.break_ms - 1):
        after, admission = admit(circuit, POLICY, T0 + elapsed, "b")
        assert not admission.allowed
        assert admission.retry_after_ms == POLICY.break_ms - elapsed
        assert (admission.before, admission.after) == ("open", "open")
        assert after == circuit


def test_retry_after_longer_than_the_break_extends_the_opening_failure() -> None:
    # Given threshold - 1 failures
    circuit = Circuit()
    for _ in range(POLICY.threshold - 1):
        circuit = record(circuit, T0)
    # When the opening failure carries a Retry-After of 5 s (break is 1 s)
    circuit, change = transition(circuit, POLICY, T0, "a", "failure", retry_after_ms=5_000)
    # Then the circuit stays open for 5 s
    assert change.open_until_ms == T0 + 5_000
    _, admission = admit(circuit, POLICY, T0 + 4_999, "b")
    assert not admission.allowed and admission.retry_after_ms == 1


def test_retry_after_shorter_than_the_break_does_not_shorten_it() -> None:
    circuit = Circuit()
    for _ in range(POLICY.threshold - 1):
        circuit = record(circuit, T0)
    _, change = transition(circuit, POLICY, T0, "a", "failure", retry_after_ms=10)
    assert change.open_until_ms == T0 + POLICY.break_ms


def test_retry_after_while_open_only_ever_moves_the_deadline_later() -> None:
    circuit = opened_at(T0)  # open until T0 + 1000
    # a later Retry-After extends
    circuit = record(circuit, T0 + 100, retry_after_ms=3_000)
    assert circuit.open_until_ms == T0 + 3_100
    # an earlier one does not shorten it
    circuit = record(circuit, T0 + 200, retry_after_ms=500)
    assert circuit.open_until_ms == T0 + 3_100
    # a failure without Retry-After changes nothing
    circuit = record(circuit, T0 + 300)
    assert circuit.open_until_ms == T0 + 3_100
    assert circuit.state == "open"


def test_after_the_break_one_probe_is_admitted_and_a_second_caller_rejected() -> None:
    circuit = opened_at(T0)
    now = T0 + POLICY.break_ms
    circuit, first = admit(circuit, POLICY, now, "probe")
    assert first == Admission(True, probe=True, before="open", after="half_open")
    circuit, second = admit(circuit, POLICY, now + 10, "other")
    assert not second.allowed and not second.probe
    assert second.retry_after_ms == POLICY.probe_lease_ms - 10
    assert (second.before, second.after) == ("half_open", "half_open")


def test_probe_success_closes() -> None:
    circuit, now = probing()
    circuit, change = transition(circuit, POLICY, now + 5, "probe", "success")
    assert (change.before, change.after) == ("half_open", "closed")
    assert circuit == Circuit()
    _, admission = admit(circuit, POLICY, now + 6, "next")
    assert admission.allowed and not admission.probe


def test_probe_failure_reopens_for_a_new_break() -> None:
    circuit, now = probing()
    circuit, change = transition(circuit, POLICY, now + 50, "probe", "failure")
    assert (change.before, change.after) == ("half_open", "open")
    assert change.open_until_ms == now + 50 + POLICY.break_ms
    assert circuit.probes == {}
    _, admission = admit(circuit, POLICY, now + 51, "next")
    assert not admission.allowed and admission.retry_after_ms == POLICY.break_ms - 1


def test_probe_failure_with_a_long_retry_after_reopens_for_longer() -> None:
    circuit, now = probing()
    _, change = transition(circuit, POLICY, now, "probe", "failure", retry_after_ms=9_000)
    assert change.open_until_ms == now + 9_000


def test_expired_probe_lease_lets_another_probe_in() -> None:
    # Given a probe that was admitted and never reported (its process crashed)
    circuit, now = probing("crashed")
    # When the lease is still running, Then others wait
    _, waiting = admit(circuit, POLICY, now + POLICY.probe_lease_ms - 1, "b")
    assert not waiting.allowed
    # When the lease has ended, Then a new probe is admitted
    circuit, admission = admit(circuit, POLICY, now + POLICY.probe_lease_ms, "b")
    assert admission.allowed and admission.probe
    assert set(circuit.probes) == {"b"}


def test_crashed_probe_reporting_late_changes_nothing() -> None:
    circuit, now = probing("crashed")
    circuit, _ = admit(circuit, POLICY, now + POLICY.probe_lease_ms, "b")
    after, change = transition(circuit, POLICY, now + 600, "crashed", "failure")
    assert not change.changed
    assert after == circuit


def test_release_frees_the_probe() -> None:
    circuit, now = probing()
    circuit, change = transition(circuit, POLICY, now + 1, "probe", "release")
    assert not change.changed
    assert circuit.state == "half_open" and circuit.probes == {}
    _, admission = admit(circuit, POLICY, now + 2, "next")
    assert admission.allowed and admission.probe


def test_late_non_probe_failure_in_half_open_changes_nothing() -> None:
    circuit, now = probing()
    after, change = transition(circuit, POLICY, now + 1, "admitted-before-open", "failure")
    assert not change.changed
    assert after == circuit
    after, change = transition(circuit, POLICY, now + 1, "late", "failure", retry_after_ms=60_000)
    assert after == circuit


def test_late_non_probe_success_in_half_open_does_not_close() -> None:
    circuit, now = probing()
    after, change = transition(circuit, POLICY, now + 1, "late", "success")
    assert not change.changed
    assert after.state == "half_open"


def test_success_while_open_does_not_close() -> None:
    circuit = opened_at(T0)
    after, change = transition(circuit, POLICY, T0 + 1, "late", "success")
    assert not change.changed and after == circuit


def test_max_probes_two_admits_two() -> None:
    policy = replace(POLICY, max_probes=2)
    circuit = opened_at(T0, policy)
    now = T0 + policy.break_ms
    circuit, first = admit(circuit, policy, now, "p1")
    circuit, second = admit(circuit, policy, now, "p2")
    circuit, third = admit(circuit, policy, now, "p3")
    assert (first.probe, second.probe) == (True, True)
    assert not third.allowed
    assert set(circuit.probes) == {"p1", "p2"}


def test_with_two_probes_the_first_result_decides() -> None:
    policy = replace(POLICY, max_probes=2)
    circuit = opened_at(T0, policy)
    now = T0 + policy.break_ms
    circuit, _ = admit(circuit, policy, now, "p1")
    circuit, _ = admit(circuit, policy, now, "p2")
    circuit, change = transition(circuit, policy, now + 1, "p1", "success")
    assert change.after == "closed"
    circuit, change = transition(circuit, policy, now + 2, "p2", "failure")
    assert (change.before, change.after, change.failures) == ("closed", "closed", 1)
