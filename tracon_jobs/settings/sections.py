"""The sections of the `Tracon` configuration and `Settings`, the one validated value they form:
each field with its type, default and rule, plus the rules that compare fields.

Keys follow the Tracon reliability guide's .NET configuration, which matches them
case-insensitively, so an operator can paste the guide's JSON (`"FailureThreshold"`) or write
Python-style names (`"failure_threshold"`) and get the same result.
"""

from __future__ import annotations

import difflib
import os
import secrets
import socket
import threading
from collections.abc import Iterator, Mapping
from datetime import timedelta
from decimal import Decimal
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, model_validator
from pydantic.alias_generators import to_pascal

from tracon_jobs.db import urls as database_urls
from tracon_jobs.providers.capabilities import (
    anthropic_response_format_rule,
    anthropic_temperature_rule,
)
from tracon_jobs.settings import defaults
from tracon_jobs.settings.broker_url import BROKER_URL_RULE, check_broker_url
from tracon_jobs.settings.errors import configuration_error
from tracon_jobs.settings.keys import normalize_key
from tracon_jobs.settings.redis_url import (
    CLUSTER_URL_RULE,
    REDIS_URL_RULE,
    check_redis_url,
    is_sentinel,
    parse_cluster_url,
    password_of,
)
from tracon_jobs.settings.types import (
    AtLeastOne,
    AtLeastZero,
    Check,
    Flag,
    LeaseDuration,
    NonEmptyStr,
    NonNegativeDecimal,
    Number,
    OptionalDuration,
    PositiveDuration,
    PositiveFloat,
    PositiveInt,
    Rule,
    TimerDuration,
    WholeNumber,
    at_least,
    between,
    broken_rule,
    shown,
)

_NO_LIMIT = Rule("zero, negative or null: no limit")

# --- the base model -----------------------------------------------------------------------


class ConfigModel(BaseModel):
    """A configuration section: immutable, strict about unknown keys, lenient about their case."""

    model_config = ConfigDict(
        extra="forbid", populate_by_name=True, frozen=True, alias_generator=to_pascal
    )

    @model_validator(mode="before")
    @classmethod
    def _match_keys(cls, data: Any) -> Any:
        """Rename incoming keys to the PascalCase aliases, so that error locations read like the
        reliability guide's setting names whatever spelling the input used. Unknown keys stay as
        given, for `extra="forbid"` to name them."""
        if not isinstance(data, Mapping):
            return data
        aliases = {
            normalize_key(field.alias or name): field.alias or name
            for name, field in cls.model_fields.items()
        }
        _suggest_for_unknown(data, aliases)
        return _renamed(data, aliases)


SUGGESTION_CUTOFF = 0.75
"""How alike (difflib's ratio, on normalized keys) an unknown key and a known one must be for the
error to suggest the known one."""


def _suggest_for_unknown(data: Mapping[Any, Any], aliases: Mapping[str, str]) -> None:
    """An unknown key close to a known one is a typo: name the key it probably meant."""
    for key in data:
        if not isinstance(key, str) or normalize_key(key) in aliases:
            continue
        close = difflib.get_close_matches(
            normalize_key(key), list(aliases), n=1, cutoff=SUGGESTION_CUTOFF
        )
        if close:
            raise broken_rule(
                f'is not a known setting; did you mean "{aliases[close[0]]}"?', setting=key
            )


def _renamed(data: Mapping[Any, Any], aliases: Mapping[str, str]) -> dict[Any, Any]:
    renamed: dict[Any, Any] = {}
    spelled: dict[Any, Any] = {}
    for key, value in data.items():
        target = aliases.get(normalize_key(key), key) if isinstance(key, str) else key
        if target in renamed:
            raise broken_rule(
                f"is given twice (as {spelled[target]!r} and {key!r})", setting=target
            )
        renamed[target], spelled[target] = value, key
    return renamed


# --- sections of the Tracon reliability guide ----------------------------------------------


class CircuitBreakerSettings(ConfigModel):
    """Per-provider circuit breaker: fail fast instead of queueing calls behind a sick provider."""

    enabled: Flag = defaults.CIRCUIT_BREAKER_ENABLED
    failure_threshold: AtLeastOne = defaults.FAILURE_THRESHOLD
    break_duration: PositiveDuration = defaults.BREAK_DURATION
    half_open_max_probes: AtLeastOne = defaults.HALF_OPEN_MAX_PROBES
    on_store_unavailable: Literal["allow", "reject"] = defaults.ON_STORE_UNAVAILABLE
    probe_lease: LeaseDuration = defaults.PROBE_LEASE


class IdempotencySettings(ConfigModel):
    """`Idempotency-Key` handling on the run submission routes."""

    enabled: Flag = defaults.IDEMPOTENCY_ENABLED
    max_key_length: AtLeastOne = defaults.MAX_IDEMPOTENCY_KEY_LENGTH


class SingletonExecutionSettings(ConfigModel):
    """Lease-based election of the one process that runs each periodic service."""

    enabled: Flag = defaults.SINGLETON_EXECUTION_ENABLED
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

    enabled: Flag = defaults.RUN_RECONCILIATION_ENABLED
    heartbeat_interval: TimerDuration = defaults.HEARTBEAT_INTERVAL
    orphan_threshold: Annotated[PositiveDuration, Rule("at least `HeartbeatInterval`")] = (
        defaults.ORPHAN_THRESHOLD
    )
    scan_interval: TimerDuration = defaults.SCAN_INTERVAL
    max_runs_per_scan: PositiveInt = defaults.MAX_RUNS_PER_SCAN

    @model_validator(mode="after")
    def _threshold_covers_heartbeat(self) -> RunReconciliationSettings:
        """A threshold shorter than the heartbeat would close runs that are alive and beating."""
        if self.orphan_threshold < self.heartbeat_interval:
            raise broken_rule(
                "must be at least RunReconciliation.HeartbeatInterval "
                f"(got {shown(self.orphan_threshold)} < {shown(self.heartbeat_interval)})",
                setting="OrphanThreshold",
            )
        return self


class RunContinuationSettings(ConfigModel):
    """Continuing an orphaned session-bound run as a new run in the same session."""

    enabled: Flag = defaults.RUN_CONTINUATION_ENABLED
    max_attempts: AtLeastZero = defaults.MAX_CONTINUATION_ATTEMPTS


class WorkflowsSettings(ConfigModel):
    """Checkpoints, resuming interrupted workflow runs from them, and the waits of a
    workflow on time and on events."""

    enable_checkpointing: Flag = defaults.ENABLE_CHECKPOINTING
    resume_interrupted_runs: Annotated[Flag, Rule("needs `EnableCheckpointing`")] = (
        defaults.RESUME_INTERRUPTED_RUNS
    )
    max_resume_attempts: Annotated[WholeNumber, between(0, defaults.MAX_RESUME_ATTEMPTS_LIMIT)] = (
        defaults.MAX_RESUME_ATTEMPTS
    )
    timer_scan_interval: PositiveDuration = defaults.TIMER_SCAN_INTERVAL
    buffer_events: Flag = defaults.BUFFER_EVENTS

    @model_validator(mode="after")
    def _resume_needs_checkpoints(self) -> WorkflowsSettings:
        """Resuming without checkpoints would restart runs from scratch while claiming to resume."""
        if self.resume_interrupted_runs and not self.enable_checkpointing:
            raise broken_rule(
                "requires Workflows.EnableCheckpointing", setting="ResumeInterruptedRuns"
            )
        return self


class AsyncRunSettings(ConfigModel):
    """The job of a queued (`Prefer: respond-async`) workflow run."""

    max_attempts: AtLeastOne = defaults.ASYNC_RUN_MAX_ATTEMPTS


def _limit(value: Number | None) -> Number | None:
    return value if value is not None and value > 0 else None


class AgentGraphSettings(ConfigModel):
    """Budgets shared by a root run and its child-agent tree.

    The raw fields keep what the operator wrote, because the reliability guide's AgentGraph table
    gives zero and negative values a meaning (a negative MaxDepth clamps to zero; a zero or
    negative limit is no limit); code reads the `*_limit` properties instead.
    """

    max_depth: Annotated[WholeNumber, Rule("negative clamps to 0")] = defaults.MAX_DEPTH
    max_total_tokens: Annotated[WholeNumber | None, _NO_LIMIT] = defaults.MAX_TOTAL_TOKENS
    max_total_cost: Annotated[Decimal | None, _NO_LIMIT] = defaults.MAX_TOTAL_COST
    max_total_runs: Annotated[WholeNumber | None, _NO_LIMIT] = defaults.MAX_TOTAL_RUNS
    max_duration: Annotated[OptionalDuration, _NO_LIMIT] = defaults.MAX_DURATION

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

    max_concurrent_calls_per_provider: Annotated[PositiveInt | None, Rule("null: no limit")] = (
        defaults.MAX_CONCURRENT_CALLS_PER_PROVIDER
    )
    slot_lease: LeaseDuration = defaults.SLOT_LEASE


class DrainSettings(ConfigModel):
    """Graceful stop: refuse new runs and wait a while for the ones in flight."""

    enabled: Flag = defaults.DRAIN_ENABLED
    timeout: PositiveDuration = defaults.DRAIN_TIMEOUT


class ApprovalsSettings(ConfigModel):
    """A person between the model and a tool call: how long they have, how often beat looks."""

    timeout: PositiveDuration = defaults.APPROVAL_TIMEOUT
    expiry_scan_interval: PositiveDuration = defaults.APPROVAL_EXPIRY_SCAN_INTERVAL


class ToolLoopSettings(ConfigModel):
    """How the tools one model turn asks for are run."""

    allow_concurrent_tool_calls: Flag = defaults.ALLOW_CONCURRENT_TOOL_CALLS


class RetentionSettings(ConfigModel):
    """Deleting old idempotency records; off unless an operator decides what may go (runs
    have `Runs.Retention`)."""

    enabled: Flag = defaults.RETENTION_ENABLED
    idempotency: PositiveDuration = defaults.IDEMPOTENCY_RETENTION

    @property
    def idempotency_retention(self) -> timedelta | None:
        """`None` while retention is off, so a caller cannot delete by forgetting `enabled`."""
        return self.idempotency if self.enabled else None


# --- tracon-jobs sections -----------------------------------------------------------------


class QuotaSettings(ConfigModel):
    """A tenant's cost quota: what it may spend in a period, in `Pricing.Currency`."""

    period: Literal["day", "month"] = Field(
        defaults.QUOTA_PERIOD,
        description="The window the spend is counted in: the current UTC `day` or calendar "
        "`month`; the quota resets when it ends.",
    )
    cost_limit: Annotated[NonNegativeDecimal | None, Rule("null: no quota")] = Field(
        defaults.QUOTA_COST_LIMIT,
        description="What the tenant may spend in the period; once spent, no model call, tool "
        "call, child run or workflow node starts and submissions answer `429`. `0` stops all "
        "paid work of the tenant.",
    )


class TenantsSettings(ConfigModel):
    """Tenant governance: the cost quota of a tenant that has none of its own
    (`tracon-jobs tenants quota` sets one per tenant)."""

    default_quota: QuotaSettings = Field(
        default_factory=QuotaSettings,
        description="The quota of every tenant without its own (none by default).",
    )
    max_concurrent_runs: AtLeastOne | None = Field(
        None,
        description="Most runs of one tenant executing at once, across the cluster; the "
        "tenant's other runs stay `Queued`, holding no worker thread, and start in order as "
        "its runs end (null: no limit).",
    )


class RunsSettings(ConfigModel):
    """Liveness of queued runs, limits of one run, and how long ended runs are kept
    (tracon-jobs additions)."""

    requeue_after: PositiveDuration = defaults.REQUEUE_AFTER
    park_after: PositiveDuration = defaults.PARK_AFTER
    park_on_open_circuit: Flag = defaults.PARK_ON_OPEN_CIRCUIT
    buffered_wait_timeout: PositiveDuration = defaults.BUFFERED_WAIT_TIMEOUT
    max_turns: AtLeastOne = defaults.MAX_TURNS
    cancel_on_disconnect: Flag = defaults.CANCEL_ON_DISCONNECT
    retention: Annotated[PositiveDuration | None, Rule("null: keep forever")] = (
        defaults.RUN_RETENTION
    )
    retention_batch: AtLeastOne = defaults.RUN_RETENTION_BATCH
    retention_scan_interval: TimerDuration = defaults.RUN_RETENTION_SCAN_INTERVAL
    archive_directory: NonEmptyStr | None = defaults.RUN_ARCHIVE_DIRECTORY


class SchedulesSettings(ConfigModel):
    """Schedules: runs started by beat at the slots of a cron expression or an interval, each
    slot once (tracon-jobs addition)."""

    enabled: Flag = defaults.SCHEDULES_ENABLED
    scan_interval: TimerDuration = defaults.SCHEDULE_SCAN_INTERVAL
    max_catch_up: Annotated[WholeNumber, between(1, defaults.SCHEDULE_MAX_CATCH_UP_LIMIT)] = (
        defaults.SCHEDULE_MAX_CATCH_UP
    )
    misfire_grace: PositiveDuration = defaults.SCHEDULE_MISFIRE_GRACE


class WorkerSettings(ConfigModel):
    """Celery worker sizing."""

    concurrency: AtLeastOne = defaults.WORKER_CONCURRENCY
    fair_reserve: Annotated[WholeNumber, at_least(0)] = defaults.WORKER_FAIR_RESERVE
    prefetch_multiplier: AtLeastOne = defaults.WORKER_PREFETCH_MULTIPLIER

    @property
    def threads(self) -> int:
        """The pool's size: the slots lined runs share, and the reserve that they never get."""
        return self.concurrency + self.fair_reserve


class WebSettings(ConfigModel):
    """The HTTP front end (tracon-jobs additions)."""

    max_request_bytes: AtLeastOne = defaults.MAX_REQUEST_BYTES
    max_streams_per_tenant: AtLeastOne = defaults.MAX_STREAMS_PER_TENANT
    keep_alive: PositiveDuration = defaults.WEB_KEEP_ALIVE


class OperatorEndpointSettings(ConfigModel):
    """The installation's own endpoint: events no tenant owns (circuits), and notices."""

    url: NonEmptyStr = Field(description="Where the operator's events are sent.")
    secret_env: NonEmptyStr = Field(
        description="Environment variable holding the endpoint's `whsec_...` secret (read at "
        "startup; never logged)."
    )
    events: list[NonEmptyStr] = Field(
        list(defaults.WEBHOOK_OPERATOR_EVENTS),
        description="The event types sent to it: `circuit.opened`, `circuit.closed`, "
        "`webhook.disabled`, and any tenant event type (every tenant's).",
    )


class WebhooksSettings(ConfigModel):
    """Signed webhooks (Standard Webhooks): endpoints per tenant (`POST /api/webhooks`), their
    delivery schedule and the destinations they may have."""

    allow_http: Flag = Field(
        False, description="Accept `http://` endpoint URLs (only `https://` otherwise)."
    )
    allow_private_networks: Flag = Field(
        False,
        description="Deliver to private, loopback and link-local addresses (refused otherwise, "
        "checked after DNS resolution at every attempt).",
    )
    backoff: list[PositiveDuration] = Field(
        list(defaults.WEBHOOK_BACKOFF),
        description="The waits before each retry of a failed delivery; its length is the "
        "number of retries (empty: one attempt).",
    )
    disable_after: PositiveDuration = defaults.WEBHOOK_DISABLE_AFTER
    timeout: PositiveDuration = defaults.WEBHOOK_TIMEOUT
    rotation_grace: PositiveDuration = defaults.WEBHOOK_ROTATION_GRACE
    poll_interval: PositiveDuration = defaults.WEBHOOK_POLL_INTERVAL
    concurrency: AtLeastOne = defaults.WEBHOOK_CONCURRENCY
    max_response_bytes: AtLeastZero = defaults.WEBHOOK_MAX_RESPONSE_BYTES
    operator: OperatorEndpointSettings | None = Field(
        None, description="The operator's endpoint (none by default)."
    )


class SlackSettings(ConfigModel):
    """A Slack app that posts approval requests with Approve / Reject buttons."""

    bot_token_env: NonEmptyStr = Field(
        description="Environment variable holding the app's bot token (`xoxb-...`)."
    )
    signing_secret_env: NonEmptyStr = Field(
        description="Environment variable holding the app's signing secret, which verifies "
        "`POST /integrations/slack/interactions`."
    )
    channel: NonEmptyStr | None = Field(
        None, description="The channel of approvals that no agent or tenant entry names."
    )
    agent_channels: dict[str, NonEmptyStr] = Field(
        {}, description="A channel per agent name (before the tenant's and the default)."
    )
    tenant_channels: dict[str, NonEmptyStr] = Field(
        {}, description="A channel per tenant name (before the default)."
    )
    users: dict[str, NonEmptyStr] = Field(
        {},
        description="The decider recorded for a Slack user id (`U123...`); a user not listed "
        "is recorded as `slack:<user id>`.",
    )
    api_url: NonEmptyStr = Field(
        "https://slack.com/api/", description="Slack's Web API (tests point it at a local fake)."
    )


class ApprovalLinksSettings(ConfigModel):
    """One-time links that decide an approval (for email or chat): a signed, expiring URL whose
    `GET` shows a confirmation page and whose `POST` decides."""

    secret_env: NonEmptyStr = Field(
        description="Environment variable holding the key that signs the links (at least 32 "
        "characters)."
    )
    public_url: NonEmptyStr = Field(
        description="The web's address as people reach it (`https://tracon.example.com`), "
        "which the links start with."
    )


class IntegrationsSettings(ConfigModel):
    """Where people are told of approvals: Slack, and one-time links (both off by default)."""

    slack: SlackSettings | None = Field(
        None, description="The Slack app that posts approval requests (none by default)."
    )
    approval_links: ApprovalLinksSettings | None = Field(
        None, description="One-time approval links (none by default)."
    )


def _database_url(url: str) -> str:
    """A URL the engine will read as written (`db.urls`: several hosts, their ports)."""
    try:
        return database_urls.check_url(url)
    except database_urls.UrlError as exc:
        raise broken_rule(str(exc)) from exc


DATABASE_URL_RULE = Check("a SQLAlchemy URL; PostgreSQL may name several hosts", _database_url)


class DatabaseSettings(ConfigModel):
    """The SQL database of runs and their records, as a SQLAlchemy URL."""

    url: Annotated[NonEmptyStr, DATABASE_URL_RULE] = defaults.DATABASE_URL
    outage_retry: PositiveDuration = defaults.DATABASE_OUTAGE_RETRY
    max_connections: AtLeastOne = defaults.DATABASE_MAX_CONNECTIONS
    prepared_statements: Flag = defaults.DATABASE_PREPARED_STATEMENTS


def _redis_url(value: str) -> str:
    try:
        check_redis_url(value)
    except ValueError as exc:
        raise broken_rule(str(exc)) from None
    return value


def _cluster_url(value: str) -> str:
    try:
        parse_cluster_url(value)
    except ValueError as exc:
        raise broken_rule(str(exc)) from None
    return value


class RedisSettings(ConfigModel):
    """The Redis server behind the Celery broker, the live event feed and coordination state:
    one server, or a Sentinel group whose current master every process follows (a failover,
    and what recovers what it loses: [Redis Sentinel](reliability.md#redis-sentinel)); the
    coordination state may go on a Redis Cluster of its own instead (`ClusterUrl`)."""

    url: Annotated[NonEmptyStr, Check(REDIS_URL_RULE, _redis_url)] = defaults.REDIS_URL
    sentinel_master: NonEmptyStr = defaults.REDIS_SENTINEL_MASTER
    password_env: NonEmptyStr | None = Field(
        None,
        description="Environment variable holding the password of Redis (the server's, or the "
        "Sentinel group's master's), read at startup and never logged; a variable that is not "
        "set fails at startup. Not with a password in `Url`.",
    )
    sentinel_password_env: NonEmptyStr | None = Field(
        None,
        description="Environment variable holding the sentinels' own password (their "
        "`requirepass`), with a `sentinel://` `Url` only; a variable that is not set fails at "
        "startup.",
    )
    cluster_url: Annotated[NonEmptyStr, Check(CLUSTER_URL_RULE, _cluster_url)] | None = (
        defaults.REDIS_CLUSTER_URL
    )
    cluster_password_env: NonEmptyStr | None = Field(
        None,
        description="Environment variable holding the password of the Redis Cluster of "
        "`ClusterUrl` (every node's), read at startup and never logged; a variable that is not "
        "set fails at startup. Only with `ClusterUrl`, and not with a password in it.",
    )

    @model_validator(mode="after")
    def _passwords_where_they_apply(self) -> RedisSettings:
        """One password for Redis, and a sentinels' password only where there are sentinels."""
        if self.password_env is not None and password_of(self.url) is not None:
            raise broken_rule(
                "Url carries a password too: keep one of the two", setting="PasswordEnv"
            )
        if self.sentinel_password_env is not None and not is_sentinel(self.url):
            raise broken_rule("needs a sentinel:// Url", setting="SentinelPasswordEnv")
        if self.cluster_password_env is not None:
            if self.cluster_url is None:
                raise broken_rule("needs a ClusterUrl", setting="ClusterPasswordEnv")
            if parse_cluster_url(self.cluster_url).password is not None:
                raise broken_rule(
                    "ClusterUrl carries a password too: keep one of the two",
                    setting="ClusterPasswordEnv",
                )
        return self


def _broker_url(value: str) -> str:
    try:
        check_broker_url(value)
    except ValueError as exc:
        raise broken_rule(str(exc)) from None
    return value


class BrokerSettings(ConfigModel):
    """Where Celery's messages go (the runs' and the periodic ticks'): `Redis:Url` unless
    `Url` says otherwise (tracon-jobs addition)."""

    url: Annotated[NonEmptyStr, Check(BROKER_URL_RULE, _broker_url)] | None = defaults.BROKER_URL


class ScriptToolCall(ConfigModel):
    """One tool call of a scripted answer."""

    name: NonEmptyStr = Field(description="Name of the tool the scripted model calls.")
    arguments: dict[str, Any] = Field(
        {}, description="Arguments of the call, as a model sends them."
    )


class ScriptStep(ConfigModel):
    """One answer of a scripted provider: text, tool calls, or an HTTP error to raise."""

    text: str | None = Field(None, description="Text the scripted model answers with.")
    tool_calls: list[ScriptToolCall] = Field(
        [], description="Tool calls the scripted model makes in this turn."
    )
    error_status: Annotated[WholeNumber, between(100, 599)] | None = Field(
        None, description="HTTP status the provider fails with instead of answering."
    )
    delay_seconds: Annotated[float, at_least(0)] = defaults.SCRIPT_DELAY_SECONDS
    input_tokens: AtLeastZero = defaults.SCRIPT_INPUT_TOKENS
    output_tokens: AtLeastZero = defaults.SCRIPT_OUTPUT_TOKENS

    @model_validator(mode="after")
    def _says_something(self) -> ScriptStep:
        """An empty step would be an empty model answer, which no real provider sends."""
        if self.text is None and not self.tool_calls and self.error_status is None:
            raise broken_rule("must set Text, ToolCalls or ErrorStatus")
        return self


class ModelRateLimits(ConfigModel):
    """Rate limits of one model of a provider (a provider's models are often limited apart)."""

    requests_per_minute: AtLeastOne | None = Field(
        None, description="Most calls to this model that start in any 60 seconds."
    )
    tokens_per_minute: AtLeastOne | None = Field(
        None, description="Most tokens of the calls to this model that start in any 60 seconds."
    )


class ProviderSettings(ConfigModel):
    """One named provider client; agents bind to it by name."""

    kind: Literal["openai", "anthropic", "scripted"] = Field(
        description="The client: `openai` for an OpenAI-compatible chat completions endpoint, "
        "`anthropic` for Anthropic's Messages API, `scripted` for scripted answers (tests, demo)."
    )
    base_url: str | None = Field(
        None,
        description="`openai`: the OpenAI-compatible base URL, up to `/v1` (null is OpenAI's); "
        "`anthropic`: the API's root, without `/v1` (null is Anthropic's).",
    )
    api_key: SecretStr | None = Field(
        None, description="The key itself; masked in messages and in dumps."
    )
    api_key_env: str | None = Field(
        None,
        description="Environment variable that holds the key, read when the client is built, so "
        "a rotated key is picked up at the next start. A variable that is not set fails at "
        "startup (set it empty for a server that needs no key).",
    )
    timeout_seconds: PositiveFloat = defaults.PROVIDER_TIMEOUT_SECONDS
    stream: Flag | None = Field(
        None,
        description="`openai` and `anthropic`: read each answer as it arrives and publish its "
        "text live to the run's followers (null or `true`); `false` waits for the whole "
        "answer. A `scripted` provider never streams and refuses `true`.",
    )
    idle_timeout_seconds: PositiveFloat | None = Field(
        None,
        description="Longest wait between two chunks of a streaming answer (at most "
        "`TimeoutSeconds`, which bounds the whole call); null is `TimeoutSeconds`.",
    )
    requests_per_minute: AtLeastOne | None = Field(
        None,
        description="Most calls to this provider that start in any 60 seconds, across the "
        "cluster; a call over it waits (null: no limit).",
    )
    tokens_per_minute: AtLeastOne | None = Field(
        None,
        description="Most tokens of the calls that start in any 60 seconds, across the "
        "cluster: each call counts its input (estimated) and its `max_tokens` (or 256), "
        "corrected by its answer's usage (null: no limit).",
    )
    models: dict[str, ModelRateLimits] = Field(
        {},
        description="Limits of one model of this provider, held besides the provider's: "
        "`RequestsPerMinute`, `TokensPerMinute`.",
    )
    script: list[ScriptStep] = Field(
        [],
        description="The `scripted` provider's answers, one per model turn; each step sets "
        "`Text`, `ToolCalls` or `ErrorStatus`.",
    )

    @model_validator(mode="after")
    def _streams_where_it_can(self) -> ProviderSettings:
        if self.kind == "scripted" and self.stream:
            raise broken_rule("Stream: a scripted provider never streams (leave it unset)")
        if self.idle_timeout_seconds is not None and (
            self.idle_timeout_seconds > self.timeout_seconds
        ):
            raise broken_rule(
                f"IdleTimeoutSeconds: at most TimeoutSeconds ({self.timeout_seconds:g}), "
                f"not {self.idle_timeout_seconds:g}"
            )
        return self

    @property
    def idle_timeout(self) -> float:
        """The longest wait between two chunks of a streaming answer, in seconds."""
        return self.idle_timeout_seconds or self.timeout_seconds

    def resolved_api_key(self, environ: Mapping[str, str] = os.environ) -> str | None:
        """The key itself, or the variable it is kept in, read when the client is built so a
        rotated key is picked up at the next start without touching the file."""
        if self.api_key is not None:
            return self.api_key.get_secret_value()
        if self.api_key_env:
            return environ.get(self.api_key_env) or None
        return None


class ModelPrice(ConfigModel):
    """What a million tokens of one model cost, in `Pricing.Currency`."""

    input_per_million: NonNegativeDecimal = Field(description="Price of a million input tokens.")
    output_per_million: NonNegativeDecimal = Field(description="Price of a million output tokens.")
    cached_input_per_million: NonNegativeDecimal | None = Field(
        None,
        description="Price of a million input tokens served from the provider's prompt cache "
        "(OpenAI's cached input, Anthropic's cache reads); null prices them as input.",
    )
    cache_write_per_million: NonNegativeDecimal | None = Field(
        None,
        description="Price of a million input tokens written to the prompt cache (Anthropic's "
        "cache writes); null prices them as input.",
    )


class PricingSettings(ConfigModel):
    """Configured prices; a model without one is priced `Unknown`, never guessed."""

    currency: NonEmptyStr = defaults.CURRENCY
    models: dict[str, ModelPrice] = Field(
        {}, description="Prices by model name; an unpriced model costs 0 with source `Unknown`."
    )

    def price_for(self, model: str) -> ModelPrice | None:
        return self.models.get(model)


class FallbackLink(ConfigModel):
    """A provider and model tried when the links before it fail transiently."""

    provider: Annotated[NonEmptyStr, Rule("a configured provider")] = Field(
        description="Provider of the fallback link."
    )
    model: NonEmptyStr = Field(description="Model called on that provider.")


class ModelBinding(ConfigModel):
    """The model an agent calls, its request options, and the links tried when it is down."""

    provider: Annotated[NonEmptyStr, Rule("a configured provider")] = Field(
        description="Provider the agent calls."
    )
    model: NonEmptyStr = Field(description="Model name sent to the provider.")
    fallbacks: list[FallbackLink] = Field(
        [], description="Links tried in order after a transient failure."
    )
    temperature: Annotated[float, between(0, 2)] | None = Field(
        None, description="Sampling temperature, sent to the model and to fallback links."
    )
    top_p: Annotated[float, between(0, 1)] | None = Field(
        None, description="Nucleus sampling, sent to the model and to fallback links."
    )
    max_output_tokens: AtLeastOne | None = Field(
        None,
        description="Sent to the model and to fallback links; also sizes a call's token "
        "reservation.",
    )
    response_format: dict[str, Any] | None = Field(
        None, description="Sent to the model as `response_format` (and to fallback links)."
    )

    def provider_links(self) -> Iterator[tuple[str, str]]:
        """Each provider the binding may call, with the setting that names it."""
        yield "Provider", self.provider
        for index, link in enumerate(self.fallbacks):
            yield f"Fallbacks[{index}].Provider", link.provider

    def links(self) -> list[tuple[str, str]]:
        """(provider, model) for the primary binding, then each fallback link in order."""
        return [(self.provider, self.model)] + [(f.provider, f.model) for f in self.fallbacks]


class ResponseCacheSettings(ConfigModel):
    """Answers to identical model requests, shared by the cluster in Redis; never used while
    the provider's circuit is open (the cache sits inside the tool-call loop)."""

    enabled: Flag = defaults.RESPONSE_CACHE_ENABLED
    ttl: PositiveDuration = defaults.RESPONSE_CACHE_TTL
    max_entries: AtLeastOne = defaults.RESPONSE_CACHE_MAX_ENTRIES


class AgentSettings(ConfigModel):
    """One named agent: its instructions, the model it calls, and the tools and agents it uses."""

    instructions: str = Field("", description="The system message.")
    model: ModelBinding
    tools: list[NonEmptyStr] = Field(
        [], description="Names of the registered `@tool` functions the model may call."
    )
    parameters: dict[str, Any] = Field(
        {},
        description="Declared parameters; a run's `parameters` are given to the model with the "
        "instructions.",
    )
    sub_agents: Annotated[list[NonEmptyStr], Rule("each a configured agent")] = Field(
        [], description="Agents the model may call as tools; each call is a child run of its tree."
    )
    require_approval: Annotated[list[NonEmptyStr], Rule("each one of the agent's Tools")] = Field(
        [],
        description="Tools whose every call waits for a person's approval, in addition to "
        "those registered `requires_approval=True`.",
    )
    cache: ResponseCacheSettings = Field(
        default_factory=ResponseCacheSettings,
        description="Cache the agent's model responses (off by default).",
    )


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
    approvals: ApprovalsSettings = Field(default_factory=ApprovalsSettings)
    tool_loop: ToolLoopSettings = Field(default_factory=ToolLoopSettings)
    retention: RetentionSettings = Field(default_factory=RetentionSettings)
    tenants: TenantsSettings = Field(default_factory=TenantsSettings)
    runs: RunsSettings = Field(default_factory=RunsSettings)
    schedules: SchedulesSettings = Field(default_factory=SchedulesSettings)
    worker: WorkerSettings = Field(default_factory=WorkerSettings)
    web: WebSettings = Field(default_factory=WebSettings)
    webhooks: WebhooksSettings = Field(default_factory=WebhooksSettings)
    integrations: IntegrationsSettings = Field(default_factory=IntegrationsSettings)
    database: DatabaseSettings = Field(default_factory=DatabaseSettings)
    redis: RedisSettings = Field(default_factory=RedisSettings)
    broker: BrokerSettings = Field(default_factory=BrokerSettings)
    providers: dict[str, ProviderSettings] = Field(
        {}, description="Provider clients by name; agents bind to them by name."
    )
    pricing: PricingSettings = Field(default_factory=PricingSettings)
    agents: dict[str, AgentSettings] = Field({}, description="Agents by name.")
    tool_modules: list[NonEmptyStr] = Field(
        [], description="Modules imported at startup, so that their `@tool` functions register."
    )
    workflow_modules: list[NonEmptyStr] = Field(
        [],
        description="Modules imported at startup, so that their `@workflow` functions register.",
    )

    @model_validator(mode="after")
    def _agents_name_known_providers(self) -> Settings:
        """A typo in a provider name must fail at startup, not at the agent's first run."""
        for agent_name, agent in self.agents.items():
            model = agent.model
            for setting, provider in model.provider_links():
                if provider not in self.providers:
                    known = ", ".join(sorted(self.providers)) or "none"
                    raise broken_rule(
                        f"must name a configured provider (got {provider!r}; configured: {known})",
                        setting=f"Agents.{agent_name}.Model.{setting}",
                    )
                if self.providers[provider].kind != "anthropic":
                    continue
                for option, rule in (
                    ("ResponseFormat", anthropic_response_format_rule(model.response_format)),
                    ("Temperature", anthropic_temperature_rule(model.temperature)),
                ):
                    if rule is not None:
                        raise broken_rule(
                            f"{rule}; the agent's Model.{setting} is {provider!r}, an "
                            "anthropic provider",
                            setting=f"Agents.{agent_name}.Model.{option}",
                        )
            for index, gated in enumerate(agent.require_approval):
                if gated not in agent.tools:
                    raise broken_rule(
                        f"must name one of the agent's Tools (got {gated!r})",
                        setting=f"Agents.{agent_name}.RequireApproval[{index}]",
                    )
            for index, child in enumerate(agent.sub_agents):
                if child not in self.agents:
                    raise broken_rule(
                        f"must name a configured agent (got {child!r})",
                        setting=f"Agents.{agent_name}.SubAgents[{index}]",
                    )
        return self

    @model_validator(mode="after")
    def _a_sentinel_broker_is_redis_url(self) -> Settings:
        """A Sentinel group's master name and passwords are `Redis:*`'s: a broker behind
        sentinels can only be that group."""
        url = self.broker.url
        if url is not None and is_sentinel(url) and url.strip() != self.redis.url.strip():
            raise broken_rule(
                "a sentinel:// broker must be Redis:Url's group (leave Broker:Url null)",
                setting="Broker.Url",
            )
        return self

    @classmethod
    def from_mapping(
        cls, data: Mapping[str, Any], sources: Mapping[tuple[str, ...], str] | None = None
    ) -> Settings:
        """Validate the contents of the `Tracon` root, reporting as `ConfigurationError`;
        `sources` names the environment variable behind each overridden setting path
        (normalized keys), so an error in one of them names its variable."""
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise configuration_error(exc, sources) from None  # the cause may quote a secret

    def missing_key_variables(self, environ: Mapping[str, str]) -> Iterator[tuple[str, str]]:
        """(setting, variable) for each provider whose `ApiKeyEnv` names an unset variable."""
        for name, provider in self.providers.items():
            variable = provider.api_key_env
            if provider.api_key is None and variable and variable not in environ:
                yield f"Providers.{name}.ApiKeyEnv", variable
        for setting, variable in self._secret_variables():
            if variable not in environ:
                yield setting, variable

    def named_variables(self) -> Iterator[str]:
        """Every environment variable a setting names (`ApiKeyEnv`, `SecretEnv`, ...), set or
        not: each configures something, whatever it is called."""
        for provider in self.providers.values():
            if provider.api_key_env:
                yield provider.api_key_env
        for _, variable in self._secret_variables():
            yield variable

    def _secret_variables(self) -> Iterator[tuple[str, str]]:
        """(setting, variable) of every secret the webhooks, integrations and Redis clients
        read at startup."""
        operator = self.webhooks.operator
        if operator is not None:
            yield "Webhooks.Operator.SecretEnv", operator.secret_env
        slack = self.integrations.slack
        if slack is not None:
            yield "Integrations.Slack.BotTokenEnv", slack.bot_token_env
            yield "Integrations.Slack.SigningSecretEnv", slack.signing_secret_env
        links = self.integrations.approval_links
        if links is not None:
            yield "Integrations.ApprovalLinks.SecretEnv", links.secret_env
        if self.redis.password_env is not None:
            yield "Redis.PasswordEnv", self.redis.password_env
        if self.redis.sentinel_password_env is not None:
            yield "Redis.SentinelPasswordEnv", self.redis.sentinel_password_env
        if self.redis.cluster_password_env is not None:
            yield "Redis.ClusterPasswordEnv", self.redis.cluster_password_env
