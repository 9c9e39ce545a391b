"""Runtime retries of one tool execution, by side-effect class (the runtime-retries guide's
retry matrix).

A re-attempt happens only when all hold: the policy allows re-attempts (`max_attempts`
counts them, 0 = none), the error is retryable (a timeout, or `RetryableToolError`), the
tool is `none`/`read` or declared `idempotent=True`, and `retry_on(error)` does not say
no. Every attempt runs under a fresh timeout but the same execution id and idempotency
key; the run's cancellation spans the whole execution and is never retried. Backoff is
exponential from `backoff_ms` and sleeps on the run's signal, so a cancel ends it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tenacity import Retrying, retry_if_exception, stop_after_attempt, wait_exponential

from tracon_jobs import metrics
from tracon_jobs.abort import AbortSignal
from tracon_jobs.agents.tools import WRITE_LIKE, ToolContext, ToolSpec
from tracon_jobs.errors import ToolCanceledError, ToolError, ToolTimeoutError
from tracon_jobs.runs.toolrunner import run_attempt

Sleep = Callable[[float], None]
OnRetry = Callable[[int, ToolError], None]  # (the attempt about to start, the last error)


def may_retry(spec: ToolSpec, error: BaseException) -> bool:
    if not isinstance(error, ToolError) or not error.retryable:
        return False
    if spec.retry.max_attempts <= 0:
        return False
    if spec.side_effect in WRITE_LIKE and not spec.idempotent:
        return False
    return spec.retry.retry_on is None or spec.retry.retry_on(error) is not False


@dataclass(frozen=True)
class Attempted:
    result: Any
    attempts: int


def run_with_retries(
    spec: ToolSpec,
    arguments: dict[str, Any],
    context: ToolContext,
    *,
    on_retry: OnRetry,
    sleep: Sleep | None = None,
    before_attempt: Callable[[], None] | None = None,
) -> Attempted:
    """Run the execution's attempts; raises the last ToolError with `.attempts` set.

    `before_attempt` runs right before each attempt's body (the executor checks there
    that the run is still its own and not canceled); what it raises ends the execution.
    """
    run_signal = context.signal
    attempt = 0

    def one_attempt() -> Any:
        nonlocal attempt
        attempt += 1
        if before_attempt is not None:
            before_attempt()
        per_attempt = run_signal.child(timeout=spec.timeout_ms / 1000)
        try:
            return run_attempt(spec, arguments, _with(context, attempt, per_attempt))
        finally:
            per_attempt.abort("done")

    def before_retry(state: Any) -> None:
        metrics.tool_retry(spec.name)
        on_retry(attempt + 1, _error_of(state.outcome))

    retrying = Retrying(
        stop=stop_after_attempt(spec.retry.max_attempts + 1),
        wait=wait_exponential(multiplier=spec.retry.backoff_ms / 1000, max=60),
        retry=retry_if_exception(lambda error: may_retry(spec, error)),
        sleep=sleep or _interruptible(run_signal),
        before_sleep=before_retry,
        reraise=True,
    )
    try:
        done = Attempted(retrying(one_attempt), attempt)
    except ToolError as error:
        error.attempts = attempt
        metrics.tool_call(spec.name, outcome_of(error))
        raise
    metrics.tool_call(spec.name, "succeeded")
    return done


def outcome_of(error: ToolError) -> str:
    """The `outcome` label of a failed tool execution: timeout, canceled or failed."""
    if isinstance(error, ToolTimeoutError):
        return "timeout"
    if isinstance(error, ToolCanceledError):
        return "canceled"
    return "failed"


def _with(context: ToolContext, attempt: int, signal: AbortSignal) -> ToolContext:
    return ToolContext(
        run_id=context.run_id,
        tool_name=context.tool_name,
        execution_id=context.execution_id,
        idempotency_key=context.idempotency_key,
        attempt=attempt,
        signal=signal,
        report_usage=context.report_usage,
    )


def _interruptible(signal: AbortSignal) -> Sleep:
    def sleep(seconds: float) -> None:
        if signal.wait(seconds):
            raise ToolCanceledError(f"cancelled during retry backoff ({signal.reason})")

    return sleep


def _error_of(outcome: Any) -> ToolError:
    error = outcome.exception() if outcome is not None else None
    return error if isinstance(error, ToolError) else ToolError(str(error))
