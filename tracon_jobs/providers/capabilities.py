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
