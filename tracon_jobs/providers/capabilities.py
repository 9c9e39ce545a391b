"""What a provider kind can honour of a model binding: checked by the settings at startup (an
agent bound to a provider that cannot honour its options is refused there, naming the setting)
and by the provider itself. No SDK is imported here."""

from __future__ import annotations

from typing import Any


def anthropic_response_format_rule(response_format: dict[str, Any] | None) -> str | None:
    """Why the Messages API cannot honour `response_format`, or None when it can: it takes
    a JSON schema (`{"type": "json_schema", "json_schema": {"schema": {...}}}`) or plain text;
    OpenAI's `json_object` mode has no counterpart."""
    if response_format is None or response_format.get("type") == "text":
        return None
    if response_format.get("type") != "json_schema":
        return (
            "an anthropic provider takes a response format of type json_schema or text "
            f"(got type {response_format.get('type')!r})"
        )
    if not isinstance(_schema_of(response_format), dict):
        return "a json_schema response format needs its json_schema.schema object"
    return None


def _schema_of(response_format: dict[str, Any]) -> Any:
    json_schema = response_format.get("json_schema")
    return json_schema.get("schema") if isinstance(json_schema, dict) else None


ANTHROPIC_MAX_TEMPERATURE = 1.0
"""The Messages API takes a temperature from 0 to 1 (OpenAI's chat completions: 0 to 2)."""


def anthropic_temperature_rule(temperature: float | None) -> str | None:
    if temperature is not None and temperature > ANTHROPIC_MAX_TEMPERATURE:
        return (
            f"an anthropic provider takes a temperature between 0 and "
            f"{ANTHROPIC_MAX_TEMPERATURE:g} (got {temperature:g})"
        )
    return None


ANTHROPIC_HAS_NONE = (
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "reasoning_effort",
    "verbosity",
)
"""Options of chat completions the Messages API has no counterpart of (its extended thinking
is a token budget, not an effort): a value that asks for something is refused."""


def anthropic_option_rule(option: str, value: Any) -> str | None:
    """Why the Messages API cannot honour a model call's `option` (a `ModelRequest` field,
    named as chat completions name it) set to `value`, or None when it can."""
    if option == "temperature":
        return anthropic_temperature_rule(value)
    if option == "response_format":
        return anthropic_response_format_rule(value)
    if option == "stop":
        return anthropic_stop_rule(value)
    if option in ANTHROPIC_HAS_NONE and asks_for_something(option, value):
        return f"an anthropic provider takes no {option} (the Messages API has none)"
    return None


def asks_for_something(option: str, value: Any) -> bool:
    """Whether an option's value changes a model call: unset never does, nor a penalty of 0
    or an empty bias; any seed does, 0 included."""
    if value is None:
        return False
    if option == "logit_bias":
        return bool(value)
    if option in ("presence_penalty", "frequency_penalty"):
        return bool(value != 0)
    return True


def anthropic_stop_rule(stop: list[str] | None) -> str | None:
    """The Messages API refuses a stop sequence of whitespace only (`stop_sequences`)."""
    for sequence in stop or []:
        if not sequence.strip():
            return (
                "an anthropic provider takes stop sequences with a character other than "
                f"whitespace (got {sequence!r})"
            )
    return None
