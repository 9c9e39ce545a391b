"""ScriptedProvider (and building it through ProviderRegistry): deterministic, stateless replies."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest

from tracon_jobs.abort import AbortSignal
from tracon_jobs.errors import ProviderError
from tracon_jobs.providers.anthropic import AnthropicProvider
from tracon_jobs.providers.base import Message, ModelRequest
from tracon_jobs.providers.registry import ProviderRegistry, build_provider
from tracon_jobs.providers.scripted import ScriptedProvider, ScriptStep, ScriptToolCall

pytestmark = pytest.mark.timeout(20)


def conversation(assistant_turns: int) -> list[Message]:
    messages: list[Message] = [{"role": "user", "content": "go"}]
    for turn in range(assistant_turns):
        messages.append({"role": "assistant", "content": f"turn {turn}"})
        messages.append({"role": "user", "content": "more"})
    return messages


def ask(provider: ScriptedProvider, assistant_turns: int = 0) -> Any:
    request = ModelRequest(model="scripted-model", messages=conversation(assistant_turns))
    return provider.complete(request, AbortSignal())


THREE_STEPS = [
    ScriptStep(text="first", input_tokens=3, output_tokens=1),
    ScriptStep(text="second"),
    ScriptStep(text="last", input_tokens=7, output_tokens=2),
]


def test_step_is_chosen_by_the_number_of_assistant_messages() -> None:
    provider = ScriptedProvider("demo", THREE_STEPS)

    answers = [ask(provider, turns).text for turns in range(3)]

    assert answers == ["first", "second", "last"]


def test_the_same_conversation_gets_the_same_answer_twice() -> None:
    provider = ScriptedProvider("demo", THREE_STEPS)

    assert ask(provider, 1).text == ask(provider, 1).text == "second"


def test_past_the_end_the_last_step_repeats() -> None:
    provider = ScriptedProvider("demo", THREE_STEPS)

    assert ask(provider, 3).text == "last"
    assert ask(provider, 10).text == "last"


def test_reply_carries_usage_the_request_model_and_stop() -> None:
    response = ask(ScriptedProvider("demo", THREE_STEPS), 0)

    assert response.model == "scripted-model"
    assert (response.usage.input_tokens, response.usage.output_tokens) == (3, 1)
    assert response.finish_reason == "stop"
    assert response.tool_calls == []


def test_tool_calls_get_deterministic_ids_and_sorted_json_arguments() -> None:
    step = ScriptStep(
        tool_calls=(
            ScriptToolCall("lookup", {"b": 2, "a": 1}),
            ScriptToolCall("notify", {"to": "ops"}),
        )
    )
    provider = ScriptedProvider("demo", [ScriptStep(text="hi"), step])

    response = ask(provider, 1)

    assert [(c.id, c.name, c.arguments) for c in response.tool_calls] == [
        ("call_1_0", "lookup", '{"a": 1, "b": 2}'),
        ("call_1_1", "notify", '{"to": "ops"}'),
    ]
    assert response.finish_reason == "tool_calls"
    assert response.as_message()["tool_calls"][0]["function"]["name"] == "lookup"
    assert json.loads(response.tool_calls[0].arguments) == {"a": 1, "b": 2}


def test_error_status_raises_an_http_provider_error() -> None:
    provider = ScriptedProvider("flaky", [ScriptStep(error_status=503)])

    with pytest.raises(ProviderError) as raised:
        ask(provider)

    assert (raised.value.status, raised.value.kind, raised.value.provider) == (503, "http", "flaky")
    assert "HTTP 503" in str(raised.value)


def test_delay_is_cut_short_by_the_signal() -> None:
    provider = ScriptedProvider("slow", [ScriptStep(text="late", delay_seconds=30)])
    signal = AbortSignal()
    threading.Timer(0.1, signal.abort, args=("cancelled",)).start()
    request = ModelRequest(model="m", messages=conversation(0))
    started = time.monotonic()

    with pytest.raises(ProviderError) as raised:
        provider.complete(request, signal)

    assert raised.value.kind == "cancelled"
    assert time.monotonic() - started < 2.0


def test_a_short_delay_still_answers() -> None:
    provider = ScriptedProvider("slow", [ScriptStep(text="ok", delay_seconds=0.05)])

    assert ask(provider).text == "ok"


def test_an_already_aborted_signal_is_not_answered() -> None:
    provider = ScriptedProvider("demo", THREE_STEPS)
    signal = AbortSignal()
    signal.abort("cancelled")

    with pytest.raises(ProviderError) as raised:
        provider.complete(ModelRequest(model="m", messages=[]), signal)

    assert raised.value.kind == "cancelled"


def test_an_empty_script_says_so() -> None:
    with pytest.raises(ProviderError, match="no script"):
        ask(ScriptedProvider("empty", []))


# Settings-shaped objects, as the settings module's pydantic models look from here.


@dataclass
class SettingsToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass
class SettingsStep:
    text: str | None = None
    tool_calls: list[SettingsToolCall] = field(default_factory=list)
    error_status: int | None = None
    delay_seconds: float = 0.0
    input_tokens: int = 0
    output_tokens: int = 0


@dataclass
class SettingsProvider:
    kind: str
    base_url: str | None = None
    api_key: str | None = None
    timeout_seconds: float = 30.0
    script: Sequence[SettingsStep] | None = None

    def resolved_api_key(self, environ: Mapping[str, str]) -> str | None:
        return self.api_key


def test_from_settings_copies_step_shaped_objects() -> None:
    steps = [SettingsStep(tool_calls=[SettingsToolCall("lookup", {"q": "x"})], input_tokens=4)]

    provider = ScriptedProvider.from_settings("demo", steps)
    steps[0].tool_calls[0].arguments["q"] = "changed later"

    response = ask(provider)
    assert response.tool_calls[0].arguments == '{"q": "x"}'
    assert response.usage.input_tokens == 4


def test_registry_builds_once_and_shares_the_provider() -> None:
    registry = ProviderRegistry(
        {"demo": SettingsProvider("scripted", script=[SettingsStep(text="hi")])}
    )

    first = registry.get("demo")

    assert first is registry.get("demo")
    assert isinstance(first, ScriptedProvider)
    assert first.complete(ModelRequest(model="m", messages=[]), AbortSignal()).text == "hi"
    registry.close_all()
    assert registry.get("demo") is not first


def test_registry_builds_one_provider_under_a_thread_race() -> None:
    registry = ProviderRegistry({"demo": SettingsProvider("scripted", script=[])})
    barrier = threading.Barrier(8)
    seen: list[object] = []

    def get() -> None:
        barrier.wait()
        seen.append(registry.get("demo"))

    threads = [threading.Thread(target=get) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert len(seen) == 8
    assert len({id(provider) for provider in seen}) == 1


def test_registry_names_an_unknown_provider() -> None:
    registry = ProviderRegistry({"demo": SettingsProvider("scripted")})

    with pytest.raises(ProviderError) as raised:
        registry.get("missing")

    assert raised.value.kind == "configuration"
    assert raised.value.status is None
    assert "missing" in str(raised.value)


def test_anthropic_builds_a_messages_api_client() -> None:
    provider = build_provider("claude", SettingsProvider("anthropic", api_key="k"))

    assert isinstance(provider, AnthropicProvider)
    assert provider.name == "claude"
