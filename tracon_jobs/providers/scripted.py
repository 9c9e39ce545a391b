"""ScriptedProvider: deterministic replies with no network, for the demo and the tests.

The step that answers is chosen from the conversation itself (the number of assistant
messages already in it), not from a counter, so the provider is stateless: a run resumed
on another worker, or replayed on a fallback link, continues the script where it stopped.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from tracon_jobs.abort import AbortSignal
from tracon_jobs.errors import ProviderError
from tracon_jobs.providers.base import ModelRequest, ModelResponse, ToolCall, Usage


class ScriptToolCallLike(Protocol):
    """A scripted tool call: ours, or the settings module's pydantic model."""

    @property
    def name(self) -> str: ...

    @property
    def arguments(self) -> Mapping[str, Any]: ...


class ScriptStepLike(Protocol):
    """A scripted reply: ours, or the settings module's pydantic model."""

    @property
    def text(self) -> str | None: ...

    @property
    def tool_calls(self) -> Sequence[ScriptToolCallLike]: ...

    @property
    def error_status(self) -> int | None: ...

    @property
    def delay_seconds(self) -> float: ...

    @property
    def input_tokens(self) -> int: ...

    @property
    def output_tokens(self) -> int: ...


@dataclass(frozen=True)
class ScriptToolCall:
    name: str
    arguments: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ScriptStep:
    """One reply; `error_status` makes it fail instead, after `delay_seconds`."""

    text: str | None = None
    tool_calls: Sequence[ScriptToolCall] = ()
    error_status: int | None = None
    delay_seconds: float = 0.0
    input_tokens: int = 0
    output_tokens: int = 0

    @classmethod
    def of(cls, step: ScriptStepLike) -> ScriptStep:
        """Copy any step-shaped object, so later edits to settings cannot change the script."""
        return cls(
            text=step.text,
            tool_calls=tuple(
                ScriptToolCall(call.name, dict(call.arguments)) for call in step.tool_calls
            ),
            error_status=step.error_status,
            delay_seconds=step.delay_seconds,
            input_tokens=step.input_tokens,
            output_tokens=step.output_tokens,
        )


class ScriptedProvider:
    """Answers each call with the script step matching the conversation's progress."""

    def __init__(self, name: str, script: Sequence[ScriptStepLike]) -> None:
        self.name = name
        self.script: tuple[ScriptStep, ...] = tuple(ScriptStep.of(step) for step in script)

    @classmethod
    def from_settings(cls, name: str, steps: Iterable[ScriptStepLike]) -> ScriptedProvider:
        return cls(name, list(steps))

    def complete(self, request: ModelRequest, signal: AbortSignal) -> ModelResponse:
        index = self._step_index(request)
        step = self.script[index]
        self._wait(step.delay_seconds, signal)
        if step.error_status is not None:
            raise ProviderError(
                f"HTTP {step.error_status} from provider '{self.name}': scripted error",
                provider=self.name,
                status=step.error_status,
                kind="http",
            )
        return _response(index, step, request.model)

    def close(self) -> None:
        """Nothing to release: the provider holds no connection."""

    def _step_index(self, request: ModelRequest) -> int:
        if not self.script:
            raise ProviderError(
                f"Scripted provider '{self.name}' has no script: give it at least one step",
                provider=self.name,
                kind="configuration",
            )
        answered = sum(1 for message in request.messages if message.get("role") == "assistant")
        return min(answered, len(self.script) - 1)

    def _wait(self, delay_seconds: float, signal: AbortSignal) -> None:
        """Sleep like a slow model would, but wake the moment the signal fires."""
        if signal.aborted or (delay_seconds > 0 and signal.wait(delay_seconds)):
            raise ProviderError(
                f"Call to provider '{self.name}' cancelled ({signal.reason})",
                provider=self.name,
                kind="cancelled",
            )


def _response(index: int, step: ScriptStep, model: str) -> ModelResponse:
    tool_calls = [
        ToolCall(
            id=f"call_{index}_{position}",
            name=call.name,
            arguments=json.dumps(dict(call.arguments), sort_keys=True),
        )
        for position, call in enumerate(step.tool_calls)
    ]
    return ModelResponse(
        model=model,
        text=step.text,
        tool_calls=tool_calls,
        usage=Usage(input_tokens=step.input_tokens, output_tokens=step.output_tokens),
        finish_reason="tool_calls" if tool_calls else "stop",
    )
