"""What a `/v1` request can set, field by field (docs/http-api.md, "What a request can set").

The agent is configured on the server. A request sets what the agent can honour for one run,
and every other field of OpenAI's request is refused rather than ignored. Each field an
OpenAI SDK can send on `/v1/chat/completions` or `/v1/responses` is one of:

- read: `model` (the agent), the conversation (`messages`, `input`, `instructions`),
  `stream` and `stream_options.include_usage`;
- a model option the run keeps (`runs.request_options`): `temperature`, `top_p`, the output
  limit, the response format, `stop`, `seed`, the penalties, `logit_bias`, the reasoning effort
  and `verbosity`; a value a provider of the agent's chain cannot take is a 400 naming it;
- kept with the run: `metadata` (the run's `input.metadata`, and the response object's);
- accepted only at the value that asks for nothing (`NEUTRAL`: `n` 1, `logprobs` false,
  `store` true, ...): any other value is a 400 (`unsupported_parameter`) saying why;
- accepted and not passed on, because by OpenAI's own definition it changes nothing of the
  answer: `user`, `safety_identifier`, the prompt cache's key and retention, and
  `parallel_tool_calls`, which governs the request's own tools, of which a request has none;
- the client's own tools (`tools`, `functions`, a `tool_choice` that asks for a call): a 400.

A field that is none of these, at the top or in an options object (`stream_options`, `text`,
`reasoning`, a response format), is a 400 too (`unknown_parameter`), as OpenAI answers it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping
from typing import Annotated, Any, ClassVar, Literal, get_args

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from tracon_jobs.providers.capabilities import anthropic_option_rule
from tracon_jobs.runs.request_options import BINDING_FIELDS, CALL_FIELDS
from tracon_jobs.settings import AgentSettings, ProviderSettings
from web.problems import Problem, bad_request

MAX_OUTPUT_LIMIT = 2**31 - 1
MAX_SEED = 2**63 - 1
MAX_STOP_SEQUENCES = 4
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512
FORMAT_NAME = r"^[a-zA-Z0-9_-]{1,64}$"
TOKEN_ID = r"^[0-9]{1,20}$"
TOOL_LISTS = {"tools", "functions"}
OPEN_TOOL_CHOICES = (None, "auto", "none")


def json_integer(value: Any) -> Any:
    """JSON's integers as JSON Schema reads them: 2 and 2.0, never `true` or "2"."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError("must be a whole number")
    return value


def one_or_list(value: Any) -> Any:
    """`stop` as OpenAI takes it: one string, or a list of them."""
    return [value] if isinstance(value, str) else value


OutputLimit = Annotated[int, BeforeValidator(json_integer), Field(ge=1, le=MAX_OUTPUT_LIMIT)]
Seed = Annotated[int, BeforeValidator(json_integer), Field(ge=-MAX_SEED - 1, le=MAX_SEED)]
Bias = Annotated[int, BeforeValidator(json_integer), Field(ge=-100, le=100)]
TokenId = Annotated[str, Field(pattern=TOKEN_ID)]
StopSequence = Annotated[str, Field(strict=True, min_length=1)]
Stop = Annotated[
    list[StopSequence], BeforeValidator(one_or_list), Field(max_length=MAX_STOP_SEQUENCES)
]
Penalty = Annotated[float, Field(strict=True, ge=-2, le=2)]
Text = Annotated[str, Field(strict=True)]
Flag = Annotated[bool, Field(strict=True)]
MetadataKey = Annotated[str, Field(max_length=MAX_METADATA_KEY)]
MetadataValue = Annotated[str, Field(strict=True, max_length=MAX_METADATA_VALUE)]
Metadata = Annotated[dict[MetadataKey, MetadataValue], Field(max_length=MAX_METADATA_PAIRS)]
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]
Verbosity = Literal["low", "medium", "high"]
REASONING_EFFORTS: tuple[str, ...] = get_args(ReasoningEffort)
VERBOSITIES: tuple[str, ...] = get_args(Verbosity)


class Options(BaseModel):
    """An object of the request: its fields are declared, and any other is found by
    `unknown_fields` (a 400 naming it)."""

    model_config = ConfigDict(extra="allow")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None


class StreamOptions(Options):
    include_usage: Flag = False
    include_obfuscation: Any = None


class ResponseStreamOptions(Options):
    include_obfuscation: Any = None


class PromptCacheOptions(Options):
    mode: Literal["implicit", "explicit"] | None = None
    ttl: Literal["30m", "12h"] | None = None
    prewarm: Any = None
    comparison_response_id: Any = None


class JsonSchema(Options):
    """A chat response format's `json_schema`."""

    name: Annotated[str, Field(strict=True, pattern=FORMAT_NAME)]
    description: Text | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: Flag | None = None


class ResponseFormat(Options):
    """Chat's `response_format`: text, JSON mode, or a JSON schema (`json_schema`)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is given with type json_schema, and only then")
        return self

    def as_option(self) -> dict[str, Any]:
        if self.json_schema is None:
            return {"type": self.type}
        spec = self.json_schema.model_dump(by_alias=True, exclude_none=True)
        return {"type": self.type, "json_schema": spec}


class TextFormat(Options):
    """The Responses API's `text.format`: the same three, the schema's fields inline."""

    type: Literal["text", "json_object", "json_schema"]
    name: Annotated[str, Field(strict=True, pattern=FORMAT_NAME)] | None = None
    description: Text | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: Flag | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> TextFormat:
        if self.type == "json_schema" and None in (self.name, self.schema_):
            raise ValueError("a json_schema format needs its name and schema")
        spec = (self.name, self.schema_, self.description, self.strict)
        if self.type != "json_schema" and spec != (None, None, None, None):
            raise ValueError("name, schema, description and strict are of a json_schema format")
        return self

    def as_option(self) -> dict[str, Any]:
        """As chat's `response_format`, the shape the run keeps and the providers read."""
        if self.type != "json_schema":
            return {"type": self.type}
        spec = self.model_dump(by_alias=True, exclude_none=True, exclude={"type"})
        return {"type": "json_schema", "json_schema": spec}


class TextOptions(Options):
    format: TextFormat | None = None
    verbosity: Verbosity | None = None


class Reasoning(Options):
    effort: ReasoningEffort | None = None
    summary: Any = None
    generate_summary: Any = None
    context: Any = None
    mode: Any = None


class AgentRequest(BaseModel):
    """What both routes take: see the module's docstring for what becomes of each field."""

    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1)
    stream: Flag = False
    temperature: float | None = Field(default=None, strict=True, ge=0, le=2)
    top_p: float | None = Field(default=None, strict=True, ge=0, le=1)
    tools: list[Any] | None = None
    tool_choice: Any = None
    metadata: Metadata | None = None
    # accepted and not passed on: by OpenAI's definition they identify the client's end user
    # to its abuse monitoring, bucket its prompt cache, or govern the request's own tools
    # (which a request cannot give): none changes the answer
    parallel_tool_calls: Flag | None = None
    user: Text | None = None
    safety_identifier: Text | None = None
    prompt_cache_key: Text | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    prompt_cache_options: PromptCacheOptions | None = None
    # accepted at the value that asks for nothing (NEUTRAL)
    store: Any = None
    service_tier: Any = None
    top_logprobs: Any = None
    moderation: Any = None

    route: ClassVar[str] = ""

    def output_limit(self) -> tuple[str, int] | None:
        """The output limit the request gives, with the field that gives it."""
        return None

    def tool_fields(self) -> dict[str, Any]:
        return {"tools": self.tools, "tool_choice": self.tool_choice}

    def model_options(self) -> dict[str, tuple[str, Any]]:
        """The model options the request gives, by their run-input names
        (`runs.request_options`), each with the field that gives it."""
        given: dict[str, tuple[str, Any]] = {
            "temperature": ("temperature", self.temperature),
            "topP": ("top_p", self.top_p),
        }
        limit = self.output_limit()
        if limit is not None:
            given["maxOutputTokens"] = limit
        return {name: (field, value) for name, (field, value) in given.items() if value is not None}


class ChatRequest(AgentRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    stream_options: StreamOptions | None = None
    max_tokens: OutputLimit | None = None
    max_completion_tokens: OutputLimit | None = None
    functions: list[Any] | None = None  # the tools' deprecated forerunners
    function_call: Any = None
    response_format: ResponseFormat | None = None
    stop: Stop | None = None
    seed: Seed | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: dict[TokenId, Bias] | None = None
    reasoning_effort: ReasoningEffort | None = None
    verbosity: Verbosity | None = None
    n: Any = None
    logprobs: Any = None
    prediction: Any = None
    audio: Any = None
    modalities: Any = None
    web_search_options: Any = None

    route: ClassVar[str] = "/v1/chat/completions"

    def output_limit(self) -> tuple[str, int] | None:
        """Both limits hold when both are given: the smaller."""
        limits = [
            (field, limit)
            for field, limit in (
                ("max_tokens", self.max_tokens),
                ("max_completion_tokens", self.max_completion_tokens),
            )
            if limit is not None
        ]
        return min(limits, key=lambda given: given[1]) if limits else None

    def tool_fields(self) -> dict[str, Any]:
        fields = super().tool_fields()
        return {**fields, "functions": self.functions, "function_call": self.function_call}

    def model_options(self) -> dict[str, tuple[str, Any]]:
        response_format = self.response_format and self.response_format.as_option()
        given = {
            "responseFormat": ("response_format", response_format),
            "stop": ("stop", self.stop or None),
            "seed": ("seed", self.seed),
            "presencePenalty": ("presence_penalty", self.presence_penalty),
            "frequencyPenalty": ("frequency_penalty", self.frequency_penalty),
            "logitBias": ("logit_bias", self.logit_bias or None),
            "reasoningEffort": ("reasoning_effort", self.reasoning_effort),
            "verbosity": ("verbosity", self.verbosity),
        }
        own = {name: pair for name, pair in given.items() if pair[1] is not None}
        return {**super().model_options(), **own}


class ResponsesRequest(AgentRequest):
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: OutputLimit | None = None
    stream_options: ResponseStreamOptions | None = None
    text: TextOptions | None = None
    reasoning: Reasoning | None = None
    background: Any = None
    background_options: Any = None
    conversation: Any = None
    previous_response_id: Any = None
    include: Any = None
    max_tool_calls: Any = None
    prompt: Any = None
    truncation: Any = None
    context_management: Any = None
    image: Any = None
    access_programs: Any = None

    route: ClassVar[str] = "/v1/responses"

    def output_limit(self) -> tuple[str, int] | None:
        limit = self.max_output_tokens
        return None if limit is None else ("max_output_tokens", limit)

    def model_options(self) -> dict[str, tuple[str, Any]]:
        text = self.text or TextOptions()
        reasoning = self.reasoning or Reasoning()
        given = {
            "responseFormat": ("text.format", text.format and text.format.as_option()),
            "verbosity": ("text.verbosity", text.verbosity),
            "reasoningEffort": ("reasoning.effort", reasoning.effort),
        }
        own = {name: pair for name, pair in given.items() if pair[1] is not None}
        return {**super().model_options(), **own}


# -- what the request asks for that a run cannot give ------------------------------------

ABSENT = (None,)

NEUTRAL: Mapping[str, tuple[tuple[Any, ...], str]] = {
    "n": ((None, 1), "a run gives one answer"),
    "logprobs": ((None, False), "the run's answer carries no log probabilities"),
    "top_logprobs": ((None, 0), "the run's answer carries no log probabilities"),
    "store": ((None, True), "every run is recorded, readable at GET /api/runs/{id}"),
    "service_tier": (
        (None, "auto", "default"),
        "every run is served alike (a tenant orders its own runs with X-Tracon-Priority)",
    ),
    "moderation": (ABSENT, "the run's input and output are not moderated here"),
    "prediction": (ABSENT, "a prediction is of one model answer, and a run makes its own calls"),
    "audio": (ABSENT, "the run answers in text"),
    "modalities": ((None, ["text"]), "the run answers in text"),
    "web_search_options": (
        ABSENT,
        "a request cannot give tools of its own, web search included: the agent's tools are "
        "configured on the server",
    ),
    "stream_options.include_obfuscation": ((None, False), "a stream carries no obfuscation"),
    "prompt_cache_options.prewarm": ((None, False), "a run answers"),
    "prompt_cache_options.comparison_response_id": (
        ABSENT,
        "no prompt cache diagnostics are answered",
    ),
    "background": (
        (None, False),
        "a run started with Prefer: respond-async is answered at once (202) and read at "
        "GET /api/runs/{id}",
    ),
    "background_options": (ABSENT, "a run is not a background response"),
    "conversation": (ABSENT, "a request gives its whole conversation in input"),
    "previous_response_id": (ABSENT, "a request gives its whole conversation in input"),
    "include": ((None, []), "a response holds its output text and usage only"),
    "max_tool_calls": (
        ABSENT,
        "the agent's tool calls are its own, and a request cannot cap them",
    ),
    "prompt": (ABSENT, "the agent's instructions are its configuration's"),
    "truncation": ((None, "disabled"), "a run never drops items from its conversation"),
    "context_management": ((None, []), "a run never compacts its conversation"),
    "image": (ABSENT, "a request's input is text only"),
    "access_programs": (ABSENT, "no access program is passed to the agent's provider"),
    "reasoning.summary": (ABSENT, "a response holds no reasoning summary"),
    "reasoning.generate_summary": (ABSENT, "a response holds no reasoning summary"),
    "reasoning.context": ((None, "auto"), "only the reasoning effort is passed on"),
    "reasoning.mode": ((None, "standard"), "only the reasoning effort is passed on"),
}
"""Each field a run cannot honour: (the values that ask for nothing, why any other cannot be
honoured). A field one route does not have is not looked for there."""


def check_request(
    body: AgentRequest, agent: AgentSettings, providers: Mapping[str, ProviderSettings]
) -> dict[str, Any]:
    """The request's model options as the run keeps them (`runs.request_options`); a 400
    naming the first field the run cannot honour."""
    for field in unknown_fields(body):
        raise Problem(
            400,
            "Bad Request",
            f"{field}: unknown parameter: POST {body.route} takes the fields "
            "GET /openapi.json describes",
            field=field,
            code="unknown_parameter",
        )
    refuse_client_tools(body)
    for field, (neutral, why) in NEUTRAL.items():
        found, value = value_at(body, field)
        if found and not any(same_json(value, accepted) for accepted in neutral):
            only = " or ".join(json.dumps(accepted) for accepted in neutral)
            raise unsupported(field, f"only {only} (got {json.dumps(value)}): {why}")
    given = body.model_options()
    for provider, _model in agent.model.links():
        if providers[provider].kind != "anthropic":
            continue
        for name, (field, value) in given.items():
            rule = anthropic_option_rule(BINDING_FIELDS.get(name) or CALL_FIELDS[name], value)
            if rule is not None:
                raise unsupported(
                    field,
                    f"{rule}, and the agent '{body.model}' calls the anthropic provider "
                    f"'{provider}'",
                )
    return {name: value for name, (_field, value) in given.items()}


def unsupported(field: str, why: str) -> Problem:
    return bad_request(f"{field}: {why}", field=field, code="unsupported_parameter")


def refuse_client_tools(body: AgentRequest) -> None:
    """A request cannot give the agent tools or make it call one: the agent's tools are
    configured on the server and called inside the run, so its client never receives a tool
    call. `tool_choice` "auto" and "none" ask for nothing more than that, and an empty
    `tools` for nothing at all."""
    for field, value in body.tool_fields().items():
        if field in TOOL_LISTS and value:
            raise unsupported(
                field,
                "a request cannot give tools of its own: the agent's tools are configured on "
                f"the server (Agents.{body.model}.Tools) and run inside the run",
            )
        if field not in TOOL_LISTS and value not in OPEN_TOOL_CHOICES:
            raise unsupported(
                field,
                f'only "auto" or "none" (got {json.dumps(value)}): the agent\'s tools are '
                f"configured on the server (Agents.{body.model}.Tools) and the agent's model "
                "decides when to call them",
            )


def unknown_fields(model: BaseModel, prefix: str = "") -> Iterator[str]:
    """The fields of the request and of its options objects that no model declares."""
    for name in model.model_extra or {}:
        yield prefix + name
    for name, spec in type(model).model_fields.items():
        value = getattr(model, name)
        if isinstance(value, Options):
            yield from unknown_fields(value, f"{prefix}{spec.alias or name}.")


def value_at(body: BaseModel, path: str) -> tuple[bool, Any]:
    """(whether the request's model has the field at `path`, its value: None when an
    object on the way is not given)."""
    value: Any = body
    for name in path.split("."):
        if value is None:
            return True, None
        if name not in type(value).model_fields:
            return False, None
        value = getattr(value, name)
    return True, value


def same_json(a: Any, b: Any) -> bool:
    """Equal as JSON values: `true` is not 1, and 1.0 is 1."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, int | float) and isinstance(b, int | float):
        return math.isfinite(a) and a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same_json(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and bool(a == b)
