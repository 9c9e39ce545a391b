"""The retry matrix of spec 004: side-effect class x idempotent x error kind, with an
injected sleep (nothing waits) and the same execution id and key across attempts."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.helpers import wait_until
from tracon_jobs.abort import AbortSignal
from tracon_jobs.agents.tools import (
    SIDE_EFFECTS,
    WRITE_LIKE,
    SideEffect,
    ToolContext,
    ToolRegistry,
    ToolSpec,
    tool,
)
from tracon_jobs.errors import (
    RetryableToolError,
    ToolCanceledError,
    ToolError,
    ToolRegistrationError,
)
from tracon_jobs.runs.retries import run_with_retries

ERRORS = {
    "timeout": None,  # the handler outlives its timeout
    "retryable": RetryableToolError("try again"),
    "business": ToolError("already refunded", code="ALREADY_REFUNDED"),
    "unexpected": ValueError("boom"),
}
EXPECTED_ATTEMPTS = {"timeout": 3, "retryable": 3, "business": 1, "unexpected": 1}
EXPECTED_CODE = {
    "timeout": "TIMEOUT",
    "retryable": "EXECUTION_FAILED",
    "business": "ALREADY_REFUNDED",
    "unexpected": "EXECUTION_FAILED",
}


class Recorder:
    def __init__(self, error: str) -> None:
        self.error = error
        self.seen: list[tuple[int, str, str]] = []

    def __call__(self, order_id: str, *, context: ToolContext) -> str:
        self.seen.append((context.attempt, context.execution_id, context.idempotency_key))
        if self.error == "timeout":
            time.sleep(0.2)
            return "late result"
        error = ERRORS[self.error]
        assert error is not None
        raise error


def register(
    side_effect: SideEffect, idempotent: bool, error: str, **options: Any
) -> tuple[ToolSpec, Recorder]:
    handler = Recorder(error)

    def refund(order_id: str, *, context: ToolContext) -> str:
        return handler(order_id, context=context)

    registry = ToolRegistry()
    tool(
        refund,
        side_effect=side_effect,
        idempotent=idempotent,
        timeout_ms=50,
        into=registry,
        **options,
    )
    spec = registry.get("refund")
    assert spec is not None
    return spec, handler


def context(signal: AbortSignal | None = None) -> ToolContext:
    return ToolContext(
        run_id="r",
        tool_name="refund",
        execution_id="exec-1",
        idempotency_key="tj-exec-1",
        attempt=1,
        signal=signal or AbortSignal(),
    )


MATRIX = list(itertools.product(SIDE_EFFECTS, [False, True], ERRORS))


@pytest.mark.parametrize(("side_effect", "idempotent", "error"), MATRIX)
def test_retry_matrix(side_effect: SideEffect, idempotent: bool, error: str) -> None:
    retry = {"max_attempts": 2, "backoff_ms": 250}
    if side_effect in WRITE_LIKE and not idempotent:
        with pytest.raises(ToolRegistrationError, match="idempotent=True"):
            register(side_effect, idempotent, error, retry=retry)
        return
    spec, handler = register(side_effect, idempotent, error, retry=retry)
    sleeps: list[float] = []
    retried: list[tuple[int, str]] = []

    with pytest.raises(ToolError) as failure:
        run_with_retries(
            spec,
            {"order_id": "o-1"},
            context(),
            sleep=sleeps.append,
            on_retry=lambda attempt, err: retried.append((attempt, err.code)),
        )

    attempts = EXPECTED_ATTEMPTS[error]
    assert failure.value.code == EXPECTED_CODE[error]
    assert failure.value.attempts == attempts
    if error == "timeout":
        # a timed-out attempt's handler runs on in a thread of its own: on a loaded machine
        # it may not have started within its 50 ms, and records its attempt later
        wait_until(lambda: len(handler.seen) >= attempts, what="every attempt", timeout=5)
    assert sorted(seen[0] for seen in handler.seen) == list(range(1, attempts + 1))
    assert {seen[1:] for seen in handler.seen} == {("exec-1", "tj-exec-1")}
    assert sleeps == [0.25, 0.5][: attempts - 1]
    assert retried == [(n, EXPECTED_CODE[error]) for n in range(2, attempts + 1)]


@pytest.mark.parametrize("side_effect", SIDE_EFFECTS)
def test_no_retry_by_default(side_effect: SideEffect) -> None:
    spec, handler = register(side_effect, False, "retryable")
    with pytest.raises(ToolError):
        run_with_retries(
            spec, {"order_id": "o"}, context(), sleep=lambda _s: None, on_retry=lambda *_: None
        )
    assert len(handler.seen) == 1


def test_retry_on_can_say_no() -> None:
    spec, handler = register(
        "read", False, "retryable", retry={"max_attempts": 3, "retry_on": lambda error: False}
    )
    with pytest.raises(ToolError):
        run_with_retries(
            spec, {"order_id": "o"}, context(), sleep=lambda _s: None, on_retry=lambda *_: None
        )
    assert len(handler.seen) == 1


def test_a_late_result_after_a_timeout_is_never_consumed() -> None:
    spec, _handler = register("read", False, "timeout")
    started = time.monotonic()
    with pytest.raises(ToolError) as failure:
        run_with_retries(spec, {"order_id": "o"}, context(), on_retry=lambda *_: None)
    assert failure.value.code == "TIMEOUT"
    assert time.monotonic() - started < 0.15, "the attempt was abandoned at its timeout"


def test_cancellation_is_terminal_and_never_retried() -> None:
    signal = AbortSignal()
    calls: list[int] = []
    registry = ToolRegistry()

    @tool(side_effect="read", retry={"max_attempts": 5}, timeout_ms=5_000, into=registry)
    def wait_forever(*, context: ToolContext) -> str:
        calls.append(context.attempt)
        context.signal.wait(5)
        return "late"

    spec = registry.get("wait_forever")
    assert spec is not None
    threading.Timer(0.05, signal.abort, args=("canceled",)).start()
    with pytest.raises(ToolCanceledError):
        run_with_retries(spec, {}, context(signal), sleep=lambda _s: None, on_retry=lambda *_: None)
    assert calls == [1]


def test_a_success_after_a_retry_reports_its_attempts() -> None:
    registry = ToolRegistry()
    outcomes: Iterator[Exception | str] = iter([RetryableToolError("flaky"), "ok"])

    @tool(side_effect="none", retry={"max_attempts": 1}, into=registry)
    def flaky() -> str:
        outcome = next(outcomes)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    spec = registry.get("flaky")
    assert spec is not None
    done = run_with_retries(spec, {}, context(), sleep=lambda _s: None, on_retry=lambda *_: None)
    assert (done.result, done.attempts) == ("ok", 2)
