"""The `Tracon` configuration: its sections, their rules, and how a file and the environment
become one validated `Settings`.

Keys follow the spec's .NET configuration, which matches them case-insensitively, so an
operator can paste the spec's JSON (`"FailureThreshold"`) or write Python-style names
(`"failure_threshold"`) and get the same result. Values that break a rule fail at startup
with a `ConfigurationError` naming the setting, never later in the middle of a run.
"""

from __future__ import annotations

import copy
import json
import math
import os
import secrets
import socket
import threading
from collections.abc import Iterator, Mapping
from datetime import timedelta
from decimal import Decimal
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    SecretStr,
    ValidationError,
    model_validator,
)
from pydantic.alias_generators import to_pascal
from pydantic_core import ErrorDetails, PydanticCustomError

from tracon_jobs import defaults
from tracon_jobs.durations import MAX_TIMER, format_duration, parse_duration
from tracon_jobs.errors import ConfigurationError

CONFIG_ENV_VAR = "TRACON_CONFIG"
"""Names the configuration file; also the setting a file problem is reported under."""

ROOT_KEY = "Tracon"
"""The file's root object, as in the spec's JSON; other roots (e.g. "Logging") are ignored."""

ENV_PREFIX = "TRACON__"
"""Environment variables with this prefix override the file; `__` separates sections."""

ENV_SHORTCUTS: Mapping[str, tuple[str, ...]] = {
    "TRACON_DATABASE_URL": ("Database", "Url"),
    "TRACON_REDIS_URL": ("Redis", "Url"),
}
"""Conventional single-variable names for the two store URLs (the `__` form wins)."""

_RULE = "tracon_rule"
_TIMER_RANGE = "must be between 1 ms and about 49.7 days"
_Number = TypeVar("_Number", int, float, Decimal)


# --- rules --------------------------------------------------------------------------------


def _broken(rule: str, setting: str | None = None) -> PydanticCustomError:
    """A rule violation that survives pydantic's wrapping with its wording intact.

    `setting` names the field when the check runs on the whole model (a cross-field rule),
    where pydantic's location would stop at the section.
    """
    context = {"rule": rule} if setting is None else {"rule": rule, "setting": setting}
    return PydanticCustomError(_RULE, "{rule}", context)


def _shown(value: object) -> str:
    return format_duration(value) if isinstance(value, timedelta) else str(value)


def _is_finite(value: float | Decimal) -> bool:
    """Pydantic lets `inf` through a float field, and `inf` is not a usable timeout."""
    if isinstance(value, int):
        return True
    return value.is_finite() if isinstance(value, Decimal) else math.isfinite(value)


def _at_least(minimum: int) -> AfterValidator:
    def check(value: _Number) -> _Number:
        if not (value >= minimum and _is_finite(value)):
            raise _broken(f"must be at least {minimum} (got {value})")
        return value

    return AfterValidator(check)


def _between(minimum: int, maximum: int) -> AfterValidator:
    def check(value: _Number) -> _Number:
        if not minimum <= value <= maximum:
            raise _broken(f"must be between {minimum} and {maximum} (got {value})")
        return value

    return AfterValidator(check)


def _positive(value: _Number) -> _Number:
    if not (value > 0 and _is_finite(value)):
        raise _broken(f"must be positive (got {value})")
    return value


def _positive_duration(value: timedelta) -> timedelta:
    if value <= timedelta(0):
        raise _broken(f"must be positive (got {format_duration(value)})")
    return value


def _timer_duration(value: timedelta) -> timedelta:
    """The spec's "1 ms to about 49.7 days": the range a .NET (and a millisecond) timer takes."""
    if not timedelta(milliseconds=1) <= value <= MAX_TIMER:
        raise _broken(f"{_TIMER_RANGE} (got {format_duration(value)})")
    return value


def _at_most_max_timer(value: timedelta) -> timedelta:
    if value > MAX_TIMER:
        raise _broken(f"must be at most about 49.7 days (got {format_duration(value)})")
    return value


def _not_blank(value: str) -> str:
    if not value.strip():
        raise _broken("must not be empty")
    return value


def _whole_number(value: object) -> object:
    """JSON `true` would otherwise count as 1; a boolean where a count belongs is a typo."""
    if isinstance(value, bool):
        raise _broken(f"must be a whole number (got {json.dumps(value)})")
    return value


def _duration(value: Any) -> timedelta:
    try:
        return parse_duration(value)
    except ValueError as exc:
        raise _broken(str(exc)) from None


def _optional_duration(value: Any) -> timedelta | None:
    return None if value is None else _duration(value)


_Int = Annotated[int, BeforeValidator(_whole_number)]
AtLeastZero = Annotated[_Int, _at_least(0)]
AtLeastOne = Annotated[_Int, _at_least(1)]
PositiveInt = Annotated[_Int, AfterValidator(_positive)]
PositiveFloat = Annotated[float, AfterValidator(_positive)]
NonEmptyStr = Annotated[str, AfterValidator(_not_blank)]
NonNegativeDecimal = Annotated[Decimal, _at_least(0)]

Duration = Annotated[
    timedelta,
    BeforeValidator(_duration),
    PlainSerializer(format_duration, return_type=str, when_used="json"),
]
"""A duration in any form `parse_duration` reads; written back as "hh:mm:ss" in JSON."""
PositiveDuration = Annotated[Duration, AfterValidator(_positive_duration)]
TimerDuration = Annotated[Duration, AfterValidator(_timer_duration)]
LeaseDuration = Annotated[
    Duration, AfterValidator(_positive_duration), AfterValidator(_at_most_max_timer)
]
OptionalDuration = Annotated[
    timedelta | None,
    BeforeValidator(_optional_duration),
    PlainSerializer(format_duration, return_type=str, when_used="json-unless-none"),
]


# --- the base model -----------------------------------------------------------------------


def normalize_key(key: str) -> str:
    """The form two keys share when the configuration treats them as the same key."""
    return key.replace("_", "").lower()


class ConfigModel(BaseModel):
    """A configuration section: immutable, strict about unknown keys, lenient about their case."""

    model_config = ConfigDict(
        extra="forbid", populate_by_name=True, frozen=True, alias_generator=to_pascal
    )

    @model_validator(mode="before")
    @classmethod
    def _match_keys(cls, data: Any) -> Any:
        """Rename incoming keys to the PascalCase aliases, so that error locations read like the
        spec's setting names whatever spelling the input used. Unknown keys stay as given, for
        `extra="forbid"` to name them."""
        if not isinstance(data, Mapping):
            return data
        aliases = {
            normalize_key(field.alias or name): field.alias or name
            for name, field in cls.model_fields.items()
        }
        return _renamed(data, aliases)


def _renamed(data: Mapping[Any, Any], aliases: Mapping[str, str]) -> dict[Any, Any]:
    renamed: dict[Any, Any] = {}
    spelled: dict[Any, Any] = {}
    for key, value in data.items():
        target = aliases.get(normalize_key(key), key) if isinstance(key, str) else key
        if target in renamed:
            raise _broken(f"is given twice (as {spelled[target]!r} and {key!r})", setting=target)
        renamed[target], spelled[target] = value, key
    return renamed


# --- the spec's sections ------------------------------------------------------------------


class CircuitBreakerSettings(ConfigModel):
    """Per-provider circuit breaker: fail fast instead of queueing calls behind a sick provider."""

    enabled: bool = defaults.CIRCUIT_BREAKER_ENABLED
    failure_threshold: AtLeastOne = defaults.FAILURE_THRESHOLD
    break_duration: PositiveDuration = defaults.BREAK_DURATION
    half_open_max_probes: AtLeastOne = defaults.HALF_OPEN_MAX_PROBES
    on_store_unavailable: Literal["allow", "reject"] = defaults.ON_STORE_UNAVAILABLE
    probe_lease: LeaseDuration = defaults.PROBE_LEASE


class IdempotencySettings(ConfigModel):
    """`Idempotency-Key` handling on the run submission routes."""

    enabled: bool = defaults.IDEMPOTENCY_ENABLED
    max_key_length: AtLeastOne = defaults.MAX_IDEMPOTENCY_KEY_LENGTH


class SingletonExecutionSettings(ConfigModel):
    """Lease-based election of the one process that runs each periodic service."""

    enabled: bool = defaults.SINGLETON_EXECUTION_ENABLED
    lease_duration: LeaseDuration = defaults.LEASE_DURATION
    owner_id: str = defaults.OWNER_ID

    def resolved_owner_id(self) -> str:
        """The configured owner, or one generated once for this instance.

        A lease is renewed and released by the owner that took it, so the generated id must
        never change between calls, even when two threads ask first at the same time. It is
        kept outside the fields, so equality and dumps see only the configuration.
        """
        if self.owner_id:
            return self.owner_id
        with _OWNER_ID_LOCK:
            generated: str = self.__dict__.setdefault("_generated_owner_id", _new_owner_id())
        return generated


_OWNER_ID_LOCK = threading.Lock()


def _new_owner_id() -> str:
    return f"{socket.gethostname()}/{os.getpid()}/{secrets.token_hex(4)}"


class RunReconciliationSettings(ConfigModel):
    """Heartbeats of live runs and the scan that closes silent ones as `orphaned`."""

    enabled: bool = defaults.RUN_RECONCILIATION_ENABLED
    heartbeat_interval: TimerDuration = defaults.HEARTBEAT_INTERVAL
    orphan_threshold: PositiveDuration = defaults.ORPHAN_THRESHOLD
    scan_interval: TimerDuration = defaults.SCAN_INTERVAL
    max_runs_per_scan: PositiveInt = defaults.MAX_RUNS_PER_SCAN

    @model_validator(mode="after")
    def _threshold_covers_heartbeat(self) -> RunReconciliationSettings:
        """A threshold shorter than the heartbeat would close runs that are alive and beating."""
        if self.orphan_threshold < self.heartbeat_interval:
            raise _broken(
                "must be at least RunReconciliation.HeartbeatInterval "
                f"(got {_shown(self.orphan_threshold)} < {_shown(self.heartbeat_interval)})",
                setting="OrphanThreshold",
            )
        return self


class RunContinuationSettings(ConfigModel):
    """Continuing an orphaned session-bound run as a new run in the same session."""

    enabled: bool = defaults.RUN_CONTINUATION_ENABLED
    max_attempts: AtLeastZero = defaults.MAX_CONTINUATION_ATTEMPTS


class WorkflowsSettings(ConfigModel):
    """Checkpoints, and resuming interrupted workflow runs from them."""

    enable_checkpointing: bool = defaults.ENABLE_CHECKPOINTING
    resume_interrupted_runs: bool = defaults.RESUME_INTERRUPTED_RUNS
    max_resume_attempts: Annotated[_Int, _between(0, defaults.MAX_RESUME_ATTEMPTS_LIMIT)] = (
        defaults.MAX_RESUME_ATTEMPTS
    )

    @model_validator(mode="after")
    def _resume_needs_checkpoints(self) -> WorkflowsSettings:
        """Resuming without checkpoints would restart runs from scratch while claiming to resume."""
        if self.resume_interrupted_runs and not self.enable_checkpointing:
            raise _broken("requires Workflows.EnableCheckpointing", setting="ResumeInterruptedRuns")
        return self


class AsyncRunSettings(ConfigModel):
    """The job of a queued (`Prefer: respond-async`) run."""

    max_attempts: AtLeastOne = defaults.ASYNC_RUN_MAX_ATTEMPTS


def _limit(value: _Number | None) -> _Number | None:
    return value if value is not None and value > 0 else None


class AgentGraphSettings(ConfigModel):
    """Budgets shared by a root run and its child-agent tree.

    The raw fields keep what the operator wrote, because the spec gives zero and negative
    values a meaning (clamp, or no limit); code reads the `*_limit` properties instead.
    """

    max_depth: _Int = defaults.MAX_DEPTH
    max_total_tokens: _Int | None = defaults.MAX_TOTAL_TOKENS
    max_total_cost: Decimal | None = defaults.MAX_TOTAL_COST
    max_total_runs: _Int | None = defaults.MAX_TOTAL_RUNS
    max_duration: OptionalDuration = defaults.MAX_DURATION

    @property
    def depth_limit(self) -> int:
        """Deepest child allowed; negative clamps to zero (only the root may run)."""
        return max(self.max_depth, 0)

    @property
    def token_limit(self) -> int | None:
        return _limit(self.max_total_tokens)

    @property
    def cost_limit(self) -> Decimal | None:
        return _limit(self.max_total_cost)

    @property
    def run_limit(self) -> int | None:
        return _limit(self.max_total_runs)

    @property
    def duration_limit(self) -> timedelta | None:
        duration = self.max_duration
        return duration if duration is not None and duration > timedelta(0) else None


class ModelConcurrencySettings(ConfigModel):
    """Cap on in-flight calls per provider, so a burst queues instead of drawing 429s."""

    max_concurrent_calls_per_provider: PositiveInt | None = (
        defaults.MAX_CONCURRENT_CALLS_PER_PROVIDER
    )
    slot_lease: LeaseDuration = defaults.SLOT_LEASE


class DrainSettings(ConfigModel):
    """Graceful stop: refuse new runs and wait a while for the ones in flight."""

    enabled: bool = defaults.DRAIN_ENABLED
    timeout: PositiveDuration = defaults.DRAIN_TIMEOUT


class ToolLoopSettings(ConfigModel):
    """How the tools one model turn asks for are run."""

    allow_concurrent_tool_calls: bool = defaults.ALLOW_CONCURRENT_TOOL_CALLS


class RetentionSettings(ConfigModel):
    """Deleting old records; off unless an operator decides what may go."""

    enabled: bool = defaults.RETENTION_ENABLED
    idempotency: PositiveDuration = defaults.IDEMPOTENCY_RETENTION

    @property
    def idempotency_retention(self) -> timedelta | None:
        """`None` while retention is off, so a caller cannot delete by forgetting `enabled`."""
        return self.idempotency if self.enabled else None


# --- tracon-jobs sections -----------------------------------------------------------------


class RunsSettings(ConfigModel):
    """Liveness of queued runs and limits of one run (tracon-jobs additions)."""

    requeue_after: PositiveDuration = defaults.REQUEUE_AFTER
    buffered_wait_timeout: PositiveDuration = defaults.BUFFERED_WAIT_TIMEOUT
    max_turns: AtLeastOne = defaults.MAX_TURNS


class WorkerSettings(ConfigModel):
    """Celery worker sizing."""

    concurrency: AtLeastOne = defaults.WORKER_CONCURRENCY
    prefetch_multiplier: AtLeastOne = defaults.WORKER_PREFETCH_MULTIPLIER


class DatabaseSettings(ConfigModel):
    url: NonEmptyStr = defaults.DATABASE_URL


class RedisSettings(ConfigModel):
    url: NonEmptyStr = defaults.REDIS_URL


class ScriptToolCall(ConfigModel):
    name: NonEmptyStr
    arguments: dict[str, Any] = {}


class ScriptStep(ConfigModel):
    """One answer of a scripted provider: text, tool calls, or an HTTP error to raise."""

    text: str | None = None
    tool_calls: list[ScriptToolCall] = []
    error_status: Annotated[_Int, _between(100, 599)] | None = None
    delay_seconds: Annotated[float, _at_least(0)] = defaults.SCRIPT_DELAY_SECONDS
    input_tokens: AtLeastZero = defaults.SCRIPT_INPUT_TOKENS
    output_tokens: AtLeastZero = defaults.SCRIPT_OUTPUT_TOKENS

    @model_validator(mode="after")
    def _says_something(self) -> ScriptStep:
        """An empty step would be an empty model answer, which no real provider sends."""
        if self.text is None and not self.tool_calls and self.error_status is None:
            raise _broken("must set Text, ToolCalls or ErrorStatus")
        return self


class ProviderSettings(ConfigModel):
    """One named provider client; agents bind to it by name."""

    kind: Literal["openai", "anthropic", "scripted"]
    base_url: str | None = None
    api_key: SecretStr | None = None
    api_key_env: str | None = None
    timeout_seconds: PositiveFloat = defaults.PROVIDER_TIMEOUT_SECONDS
    script: list[ScriptStep] = []

    def resolved_api_key(self, environ: Mapping[str, str] = os.environ) -> str | None:
        """The key itself, or the variable it is kept in, read when the client is built so a
        rotated key is picked up at the next start without touching the file."""
        if self.api_key is not None:
            return self.api_key.get_secret_value()
        if self.api_key_env:
            return environ.get(self.api_key_env) or None
        return None


class ModelPrice(ConfigModel):
    input_per_million: NonNegativeDecimal
    output_per_million: NonNegativeDecimal


class PricingSettings(ConfigModel):
    """Configured prices; a model without one is priced `Unknown`, never guessed."""

    currency: NonEmptyStr = defaults.CURRENCY
    models: dict[str, ModelPrice] = {}

    def price_for(self, model: str) -> ModelPrice | None:
        return self.models.get(model)


class FallbackLink(ConfigModel):
    provider: NonEmptyStr
    model: NonEmptyStr


class ModelBinding(ConfigModel):
    """The model an agent calls, its request options, and the links tried when it is down."""

    provider: NonEmptyStr
    model: NonEmptyStr
    fallbacks: list[FallbackLink] = []
    temperature: Annotated[float, _between(0, 2)] | None = None
    top_p: Annotated[float, _between(0, 1)] | None = None
    max_output_tokens: AtLeastOne | None = None
    response_format: dict[str, Any] | None = None

    def provider_links(self) -> Iterator[tuple[str, str]]:
        """Each provider the binding may call, with the setting that names it."""
        yield "Provider", self.provider
        for index, link in enumerate(self.fallbacks):
            yield f"Fallbacks[{index}].Provider", link.provider

    def links(self) -> list[tuple[str, str]]:
        """(provider, model) for the primary binding, then each fallback link in order."""
        return [(self.provider, self.model)] + [(f.provider, f.model) for f in self.fallbacks]


class AgentSettings(ConfigModel):
    instructions: str = ""
    model: ModelBinding
    tools: list[NonEmptyStr] = []
    parameters: dict[str, Any] = {}
    sub_agents: list[NonEmptyStr] = []
    """Agents this agent may call as tools; each call is a child run of its tree."""


# --- the whole configuration --------------------------------------------------------------


class Settings(ConfigModel):
    """Everything under the `Tracon` root, validated as one value."""

    circuit_breaker: CircuitBreakerSettings = Field(default_factory=CircuitBreakerSettings)
    idempotency: IdempotencySettings = Field(default_factory=IdempotencySettings)
    singleton_execution: SingletonExecutionSettings = Field(
        default_factory=SingletonExecutionSettings
    )
    run_reconciliation: RunReconciliationSettings = Field(default_factory=RunReconciliationSettings)
    run_continuation: RunContinuationSettings = Field(default_factory=RunContinuationSettings)
    workflows: WorkflowsSettings = Field(default_factory=WorkflowsSettings)
    async_run: AsyncRunSettings = Field(default_factory=AsyncRunSettings)
    agent_graph: AgentGraphSettings = Field(default_factory=AgentGraphSettings)
    model_concurrency: ModelConcurrencySettings = Field(default_factory=ModelConcurrencySettings)
    drain: DrainSettings = Field(default_factory=DrainSettings)
    tool_loop: ToolLoopSettings = Field(default_factory=ToolLoopSettings)
    retention: RetentionSettings = Field(default_factory=RetentionSettings)
    runs: RunsSettings = Field(default_factory=RunsSettings)
    worker: WorkerSettings = Field(default_factory=WorkerSettings)
    database: DatabaseSettings = Field(default_factory=DatabaseSettings)
    redis: RedisSettings = Field(default_factory=RedisSettings)
    providers: dict[str, ProviderSettings] = {}
    pricing: PricingSettings = Field(default_factory=PricingSettings)
    agents: dict[str, AgentSettings] = {}
    tool_modules: list[NonEmptyStr] = []

    @model_validator(mode="after")
    def _agents_name_known_providers(self) -> Settings:
        """A typo in a provider name must fail at startup, not at the agent's first run."""
        for agent_name, agent in self.agents.items():
            for setting, provider in agent.model.provider_links():
                if provider not in self.providers:
                    known = ", ".join(sorted(self.providers)) or "none"
                    raise _broken(
                        f"must name a configured provider (got {provider!r}; configured: {known})",
                        setting=f"Agents.{agent_name}.Model.{setting}",
                    )
            for index, child in enumerate(agent.sub_agents):
                if child not in self.agents:
                    raise _broken(
                        f"must name a configured agent (got {child!r})",
                        setting=f"Agents.{agent_name}.SubAgents[{index}]",
                    )
        return self

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> Settings:
        """Validate the contents of the `Tracon` root, reporting as `ConfigurationError`."""
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise configuration_error(exc) from None  # the cause may quote a secret

    def model_dump_public(self) -> dict[str, Any]:
        """The configuration in its file shape, for display: secrets masked, durations as text."""
        return self.model_dump(mode="json", by_alias=True)


# --- validation errors as ConfigurationError ----------------------------------------------

_PHRASES = {
    "missing": "is required",
    "extra_forbidden": "is not a known setting",
    "bool": "must be true or false",
    "int": "must be a whole number",
    "float": "must be a number",
    "decimal": "must be a number",
    "finite": "must be a finite number",
    "string": "must be a string",
    "dict": "must be an object",
    "model": "must be an object",
    "list": "must be a list",
}


def configuration_error(exc: ValidationError) -> ConfigurationError:
    """The first problem pydantic found, named the way the operator wrote the setting."""
    error = exc.errors(include_url=False)[0]
    setting = _setting_path(error)
    return ConfigurationError(setting or ROOT_KEY, _rule_of(error, setting))


def _setting_path(error: ErrorDetails) -> str:
    path = ""
    for part in error["loc"]:
        path += f"[{part}]" if isinstance(part, int) else f".{part}"
    suffix = error.get("ctx", {}).get("setting") if error["type"] == _RULE else None
    if suffix:
        path += f".{suffix}"
    return path.lstrip(".")


def _rule_of(error: ErrorDetails, setting: str) -> str:
    context = error.get("ctx", {})
    if error["type"] == _RULE:
        return str(context["rule"])
    if error["type"] == "literal_error":
        return f"must be one of {context['expected']}{_got(error, setting)}"
    if error["type"] in ("missing", "extra_forbidden"):
        return _PHRASES[error["type"]]
    family = error["type"].split("_")[0]
    return f"{_PHRASES.get(family, error['msg'])}{_got(error, setting)}"


def _got(error: ErrorDetails, setting: str) -> str:
    """The offending value, quoted as JSON, unless the setting holds a secret."""
    if normalize_key(setting.rsplit(".", 1)[-1]) == "apikey":
        return ""
    shown = json.dumps(error["input"], default=str)
    return f" (got {shown if len(shown) <= 80 else shown[:77] + '...'})"


# --- loading ------------------------------------------------------------------------------


def load_settings(
    config_path: str | os.PathLike[str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> Settings:
    """Read the file (if any), lay the environment over it, and validate the result.

    The file is `config_path`, else `$TRACON_CONFIG`, else `tracon.json` in the working
    directory when it exists; with none of them the defaults apply.
    """
    environ = os.environ if environ is None else environ
    data = _read_root(_config_file(config_path, environ))
    return Settings.from_mapping(apply_environment(data, environ))


def _config_file(
    config_path: str | os.PathLike[str] | None, environ: Mapping[str, str]
) -> Path | None:
    named = config_path if config_path is not None else environ.get(CONFIG_ENV_VAR) or None
    if named is None:
        default = Path(defaults.CONFIG_FILE)
        return default if default.is_file() else None
    if not Path(named).is_file():
        raise ConfigurationError(CONFIG_ENV_VAR, f"no configuration file at {os.fspath(named)}")
    return Path(named)


def _read_root(path: Path | None) -> dict[str, Any]:
    if path is None:
        return {}
    try:
        document = json.loads(path.read_text(encoding="utf-8-sig"))  # .NET tools write a BOM
    except OSError as exc:
        raise ConfigurationError(CONFIG_ENV_VAR, f"cannot read {path}: {exc.strerror}") from exc
    except json.JSONDecodeError as exc:
        rule = f"{path} is not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})"
        raise ConfigurationError(CONFIG_ENV_VAR, rule) from None
    return _tracon_root(document, path)


def _tracon_root(document: Any, path: Path) -> dict[str, Any]:
    """The `Tracon` object; the root's name is matched case-insensitively like every key."""
    roots = document.items() if isinstance(document, dict) else []
    for key, value in roots:
        if normalize_key(key) == normalize_key(ROOT_KEY):
            if not isinstance(value, dict):
                raise ConfigurationError(ROOT_KEY, f"must be a JSON object in {path}")
            return value
    raise ConfigurationError(ROOT_KEY, f'{path} has no "{ROOT_KEY}" root object')


def apply_environment(data: Mapping[str, Any], environ: Mapping[str, str]) -> dict[str, Any]:
    """Lay `TRACON__...` variables (and the URL shortcuts) over the file's `Tracon` object."""
    merged = copy.deepcopy(dict(data))
    for name, path in _overrides(environ):
        _set_path(merged, path, _env_value(name, environ[name]))
    return merged


def _overrides(environ: Mapping[str, str]) -> Iterator[tuple[str, tuple[str, ...]]]:
    """Shortcuts first, so the explicit `TRACON__DATABASE__URL` form is applied last and wins."""
    for name, path in ENV_SHORTCUTS.items():
        if name in environ:
            yield name, path
    for name in sorted(environ):
        if name.upper().startswith(ENV_PREFIX):
            yield name, _env_path(name)


def _env_path(name: str) -> tuple[str, ...]:
    path = tuple(name[len(ENV_PREFIX) :].split("__"))
    if not all(path):
        raise ConfigurationError(name, "has an empty section name between '__' separators")
    return path


def _env_value(name: str, text: str) -> Any:
    """JSON for objects, arrays and null; everything else stays text for pydantic to convert."""
    stripped = text.strip()
    if stripped.lower() == "null":
        return None
    if not stripped.startswith(("[", "{")):
        return text
    try:
        return json.loads(stripped)
    except json.JSONDecodeError as exc:
        raise ConfigurationError(name, f"looks like JSON but does not parse: {exc.msg}") from None


def _set_path(node: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    for segment in path[:-1]:
        key = _existing_key(node, segment)
        if not isinstance(node.get(key), dict):
            node[key] = {}
        node = node[key]
    key = _existing_key(node, path[-1])
    if isinstance(value, dict) and isinstance(node.get(key), dict):
        _deep_merge(node[key], value)
    else:
        node[key] = value


def _deep_merge(target: dict[str, Any], source: Mapping[str, Any]) -> None:
    for segment, value in source.items():
        _set_path(target, (segment,), value)


def _existing_key(node: Mapping[str, Any], segment: str) -> str:
    """The key already present under another spelling, so an override replaces it rather
    than adding a twin; a new key (an agent's name) keeps the case it was given."""
    wanted = normalize_key(segment)
    return next((key for key in node if normalize_key(key) == wanted), segment)
