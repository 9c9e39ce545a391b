"""The tool-call loop that executes one claimed run, as a set of small named steps.

    claim -> resolve agent, provider, tools -> [check live -> model call -> record spend
          -> (tool calls: ledger started -> attempt -> ledger outcome) -> save turn]*
          -> one fenced final write

Every write goes through the claim's fence; `RunTakenAway` from any of them stops the
executor before its next model or tool call, and a zombie never writes a result.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tracon_jobs.agents.tools import ToolContext, ToolSpec
from tracon_jobs.db.models import Run
from tracon_jobs.errors import ConfigurationError, ProviderError, RunCancelled, RunTakenAway, ToolError
from tracon_jobs.pricing import price
from tracon_jobs.providers.base import Message, ModelRequest, ModelResponse, Provider, ToolCall
from tracon_jobs.runs.ledger import Ledger, ToolOutcome
from tracon_jobs.runs.lifecycle import Claim, ErrorClass, RunError, RunStatus
from tracon_jobs.runs.store import TurnSpend
from tracon_jobs.runs.toolrunner import run_attempt
from tracon_jobs.signal import AbortSignal

if TYPE_CHECKING:
    from tracon_jobs.runtime import Runtime
    from tracon_jobs.settings import AgentSettings

log = logging.getLogger(__name__)


class RunFailure(Exception):
    """Ends the run `Failed` with a typed error."""

    def __init__(self, error: RunError) -> None:
        super().__init__(error.message)
        self.error = error


@dataclass
class _Turn:
    claim: Claim
    agent: AgentSettings
    provider: Provider
    tools: dict[str, ToolSpec]
    signal: AbortSignal


class RunExecutor:
    def __init__(self, runtime: Runtime) -> None:
        self.rt = runtime
        self.ledger = Ledger(runtime.runs)

    def execute(self, run_id: str) -> str:
        """Claim and run `run_id`; what happened, for logs and tests."""
        claim = self.rt.runs.claim(run_id, self.rt.owner_id)
        if claim is None:
            log.info("run %s is not Queued; delivery acknowledged and dropped", run_id)
            return "dropped"
        run = self.rt.runs.get(run_id)
        assert run is not None
        signal = AbortSignal()
        try:
            return self._run_to_end(claim, run, signal).value
        except RunTakenAway:
            log.warning("run %s was taken away from fence %s; stopping", run_id, claim.fence)
            return "taken_away"

    def _run_to_end(self, claim: Claim, run: Run, signal: AbortSignal) -> RunStatus:
        try:
            output = self._tool_loop(self._prepare(claim, run, signal), run)
        except RunFailure as failure:
            return self._finish(claim, RunStatus.FAILED, error=failure.error)
        except RunCancelled as cancelled:
            error = RunError("canceled", ErrorClass.CANCELLATION, str(cancelled) or "canceled")
            return self._finish(claim, RunStatus.CANCELED, error=error)
        except (RunTakenAway, KeyboardInterrupt, SystemExit):
            raise
        except Exception as exc:  # a bug must close the run, not strand it
            log.exception("run %s failed unexpectedly", claim.run_id)
            error = RunError("internal_error", ErrorClass.INTERNAL, f"{type(exc).__name__}: {exc}")
            return self._finish(claim, RunStatus.FAILED, error=error)
        return self._finish(claim, RunStatus.COMPLETED, output=output)

    def _finish(
        self,
        claim: Claim,
        status: RunStatus,
        *,
        output: dict[str, Any] | None = None,
        error: RunError | None = None,
    ) -> RunStatus:
        if self.rt.runs.finish(claim, status, output=output, error=error) is None:
            raise RunTakenAway(claim.run_id)
        return status

    # -- preparation -------------------------------------------------------------------

    def _prepare(self, claim: Claim, run: Run, signal: AbortSignal) -> _Turn:
        agent = self.rt.settings.agents.get(run.agent)
        if agent is None:
            raise _config_failure(f"agent '{run.agent}' is not configured")
        try:
            provider = self.rt.providers.get(agent.model.provider)
        except (ProviderError, ConfigurationError) as exc:
            raise _config_failure(str(exc)) from exc
        return _Turn(claim, agent, provider, self._resolve_tools(agent), signal)

    def _resolve_tools(self, agent: AgentSettings) -> dict[str, ToolSpec]:
        tools: dict[str, ToolSpec] = {}
        for name in agent.tools:
            spec = self.rt.tools.get(name)
            if spec is None:
                raise _config_failure(f"tool '{name}' is not registered (check ToolModules)")
            tools[name] = spec
        return tools

    # -- the loop ----------------------------------------------------------------------

    def _tool_loop(self, turn: _Turn, run: Run) -> dict[str, Any]:
        messages: list[Message] = list(run.messages or initial_messages(turn.agent, run))
        index = run.turns_completed
        while index < self.rt.settings.runs.max_turns:
            self._check_live(turn)
            response = self._model_call(turn, messages, index)
            if not response.tool_calls:
                return {"text": response.text or ""}
            messages.append(response.as_message())
            for call in response.tool_calls:
                self._check_live(turn)
                messages.append(self._tool_call(turn, index, call))
            index += 1
            self.rt.runs.save_turn(turn.claim, messages, index)
        raise RunFailure(
            RunError(
                "max_turns_exceeded",
                ErrorClass.QUOTA_EXCEEDED,
                f"the run used all {self.rt.settings.runs.max_turns} model turns "
                "(raise Tracon:Runs:MaxTurns)",
            )
        )

    def _check_live(self, turn: _Turn) -> None:
        if turn.signal.aborted:
            raise RunCancelled(turn.signal.reason)

    def _model_call(self, turn: _Turn, messages: list[Message], index: int) -> ModelResponse:
        binding = turn.agent.model
        request = ModelRequest(
            model=binding.model,
            messages=messages,
            tools=[spec.openai_schema() for spec in turn.tools.values()],
            temperature=binding.temperature,
            top_p=binding.top_p,
            max_output_tokens=binding.max_output_tokens,
            response_format=binding.response_format,
        )
        started = {"turn": index, "provider": binding.provider, "model": binding.model}
        self.rt.runs.append(turn.claim, "ModelCallStarted", started)
        try:
            response = turn.provider.complete(request, turn.signal)
        except ProviderError as exc:
            if exc.kind == "cancelled" and turn.signal.aborted:
                raise RunCancelled(turn.signal.reason) from exc
            raise RunFailure(provider_error(exc)) from exc
        self._record_spend(turn, response, index)
        return response

    def _record_spend(self, turn: _Turn, response: ModelResponse, index: int) -> None:
        amount, source = price(self.rt.settings.pricing, response.model, response.usage)
        spend = TurnSpend(
            model_id=response.model,
            input_tokens=response.usage.input_tokens,
            output_tokens=response.usage.output_tokens,
            cost=amount,
            cost_source=source,
        )
        data = {
            "turn": index,
            "provider": turn.agent.model.provider,
            "model": response.model,
            "finishReason": response.finish_reason,
            "toolCalls": len(response.tool_calls),
            "usage": {
                "inputTokens": spend.input_tokens,
                "outputTokens": spend.output_tokens,
            },
            "cost": {"amount": float(amount), "source": source},
        }
        self.rt.runs.record_spend(turn.claim, spend, data)

    # -- tool calls --------------------------------------------------------------------

    def _tool_call(self, turn: _Turn, index: int, call: ToolCall) -> Message:
        arguments, parse_error = parse_arguments(call.arguments)
        entry = self.ledger.start(turn.claim, index, call.id, call.name, arguments)
        spec = turn.tools.get(call.name)
        if parse_error is not None or spec is None:
            outcome = ToolOutcome(
                ok=False,
                error_code="INVALID_ARGUMENTS" if spec else "UNKNOWN_TOOL",
                error_message=parse_error or f"no tool named '{call.name}' is available",
            )
        else:
            outcome = self._attempt(
                turn, spec, arguments, entry.execution_id, entry.idempotency_key
            )
        self.ledger.finish(turn.claim, entry, call.name, outcome)
        return {"role": "tool", "tool_call_id": call.id, "content": outcome.as_model_content()}

    def _attempt(
        self, turn: _Turn, spec: ToolSpec, arguments: dict[str, Any], execution_id: str, key: str
    ) -> ToolOutcome:
        context = ToolContext(
            run_id=turn.claim.run_id,
            tool_name=spec.name,
            execution_id=execution_id,
            idempotency_key=key,
            attempt=1,
            signal=turn.signal.child(timeout=spec.timeout_ms / 1000),
        )
        try:
            result = run_attempt(spec, arguments, context)
        except ToolError as exc:
            return ToolOutcome(ok=False, error_code=exc.code, error_message=str(exc))
        finally:
            context.signal.abort("done")
        return ToolOutcome(ok=True, result=result)


def initial_messages(agent: AgentSettings, run: Run) -> list[Message]:
    messages: list[Message] = []
    system = agent.instructions
    if run.parameters:
        system = f"{system}\n\nParameters: {json.dumps(run.parameters, sort_keys=True)}".strip()
    if system:
        messages.append({"role": "system", "content": system})
    messages.append({"role": "user", "content": str(run.input.get("message", ""))})
    return messages


def parse_arguments(raw: str) -> tuple[dict[str, Any], str | None]:
    try:
        value = json.loads(raw or "{}")
    except json.JSONDecodeError as exc:
        return {"_raw": raw}, f"arguments are not valid JSON: {exc}"
    if not isinstance(value, dict):
        return {"_raw": raw}, "arguments must be a JSON object"
    return value, None


def provider_error(exc: ProviderError) -> RunError:
    if exc.kind == "configuration":
        return RunError("configuration_error", ErrorClass.CONFIGURATION, str(exc))
    if exc.kind == "unavailable":
        return RunError("provider_unavailable", ErrorClass.PROVIDER, str(exc))
    return RunError("provider_error", ErrorClass.PROVIDER, str(exc))


def _config_failure(message: str) -> RunFailure:
    return RunFailure(RunError("configuration_error", ErrorClass.CONFIGURATION, message))
