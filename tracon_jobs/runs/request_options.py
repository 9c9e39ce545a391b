"""A run's own model options: what an OpenAI-compatible request (`/v1`) asked of the model
(its `temperature`, `top_p`, output limit, response format, stop sequences, seed, penalties,
logit bias, reasoning effort and verbosity), kept in the run's input under `options` so that
every execution of the run, a continuation's included, calls the model with them.

The options the agent's `Model` has (`BINDING_FIELDS`) replace the binding's of the same name;
the others (`CALL_FIELDS`) are added to each model call of the run. Both hold on every
fallback link; the run's sub-agents are runs of their own and keep their agents'. The web
edge checks them (ranges, and what each provider of the agent's chain takes) before the run is
recorded, so what is stored here is already valid."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tracon_jobs.settings import AgentSettings

OPTIONS_KEY = "options"
"""The run input's key of the options, e.g. `{"temperature": 0.2, "maxOutputTokens": 200}`."""

BINDING_FIELDS: Mapping[str, str] = {
    "temperature": "temperature",
    "topP": "top_p",
    "maxOutputTokens": "max_output_tokens",
    "responseFormat": "response_format",
}
"""Each option's name in the run input -> the `ModelBinding` field it replaces."""

CALL_FIELDS: Mapping[str, str] = {
    "stop": "stop",
    "seed": "seed",
    "presencePenalty": "presence_penalty",
    "frequencyPenalty": "frequency_penalty",
    "logitBias": "logit_bias",
    "reasoningEffort": "reasoning_effort",
    "verbosity": "verbosity",
}
"""Each option's name in the run input -> the `ModelRequest` field it sets (the agent's
`Model` has none of these)."""

TEXT_FORMAT = {"type": "text"}
"""The response format that asks for plain text: the run's calls are sent none."""


def run_options(run_input: Mapping[str, Any] | None) -> dict[str, Any]:
    """The options a run's input gives (none: `{}`), by their run-input names."""
    given = (run_input or {}).get(OPTIONS_KEY)
    if not isinstance(given, Mapping):
        return {}
    known = BINDING_FIELDS.keys() | CALL_FIELDS.keys()
    return {name: value for name, value in given.items() if name in known}


def with_run_options(agent: AgentSettings, run_input: Mapping[str, Any] | None) -> AgentSettings:
    """The agent as this run calls it: its model binding with the run's options laid over (a
    text response format replaces the agent's `ResponseFormat` with none)."""
    update = {
        BINDING_FIELDS[name]: None if value == TEXT_FORMAT else value
        for name, value in run_options(run_input).items()
        if name in BINDING_FIELDS
    }
    if not update:
        return agent
    return agent.model_copy(update={"model": agent.model.model_copy(update=update)})


def call_options(run_input: Mapping[str, Any] | None) -> dict[str, Any]:
    """The `ModelRequest` fields the run's options set on each of its model calls."""
    return {
        CALL_FIELDS[name]: value
        for name, value in run_options(run_input).items()
        if name in CALL_FIELDS
    }
