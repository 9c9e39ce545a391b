"""Settings: the spec's baseline, defaults, every validation rule, durations, and overrides."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from datetime import timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from tracon_jobs.errors import ConfigurationError
from tracon_jobs.settings import Settings, defaults, load_settings
from tracon_jobs.settings.durations import MAX_TIMER, format_duration, parse_duration

# Copied verbatim from the spec ("A useful production baseline is:").
PRODUCTION_BASELINE = """
{
  "Tracon": {
    "CircuitBreaker": {
      "Enabled": true,
      "FailureThreshold": 5,
      "BreakDuration": "00:00:30"
    },
    "Idempotency": {
      "Enabled": true,
      "MaxKeyLength": 255
    },
    "SingletonExecution": {
      "Enabled": true,
      "LeaseDuration": "00:01:00"
    },
    "RunReconciliation": {
      "Enabled": true,
      "HeartbeatInterval": "00:00:30",
      "OrphanThreshold": "00:05:00",
      "ScanInterval": "00:01:00",
      "MaxRunsPerScan": 100
    },
    "AgentGraph": {
      "MaxDepth": 3,
      "MaxTotalTokens": 200000,
      "MaxTotalRuns": 25
    },
    "ModelConcurrency": {
      "MaxConcurrentCallsPerProvider": null
    }
  }
}
"""

PROVIDER = {"Providers": {"p": {"Kind": "scripted", "Script": [{"Text": "hi"}]}}}


def write_config(tmp_path: Path, tracon: Mapping[str, Any], **roots: Any) -> Path:
    path = tmp_path / "tracon.json"
    path.write_text(json.dumps({"Tracon": tracon, **roots}), encoding="utf-8")
    return path


def load(tmp_path: Path, tracon: Mapping[str, Any], **environ: str) -> Settings:
    return load_settings(write_config(tmp_path, tracon), environ=environ)


def with_agent(**model: Any) -> dict[str, Any]:
    """An agent `a` bound to provider `p`, with `model` laid over its binding."""
    return {**PROVIDER, "Agents": {"a": {"Model": {"Provider": "p", "Model": "m", **model}}}}


# --- the baseline and the defaults ---------------------------------------------------------


def test_the_spec_production_baseline_loads_verbatim(tmp_path: Path) -> None:
    path = tmp_path / "baseline.json"
    path.write_text(PRODUCTION_BASELINE, encoding="utf-8")

    settings = load_settings(path, environ={})

    assert settings.circuit_breaker.enabled is True
    assert settings.circuit_breaker.failure_threshold == 5
    assert settings.circuit_breaker.break_duration == timedelta(seconds=30)
    assert settings.idempotency.max_key_length == 255
    assert settings.singleton_execution.enabled is True
    assert settings.singleton_execution.lease_duration == timedelta(minutes=1)
    reconciliation = settings.run_reconciliation
    assert reconciliation.enabled is True
    assert reconciliation.heartbeat_interval == timedelta(seconds=30)
    assert reconciliation.orphan_threshold == timedelta(minutes=5)
    assert reconciliation.scan_interval == timedelta(minutes=1)
    assert reconciliation.max_runs_per_scan == 100
    assert settings.agent_graph.depth_limit == 3
    assert settings.agent_graph.token_limit == 200_000
    assert settings.agent_graph.run_limit == 25
    assert settings.model_concurrency.max_concurrent_calls_per_provider is None


def test_defaults_apply_without_a_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # no tracon.json here

    settings = load_settings(environ={})

    assert settings == Settings()
    assert settings.circuit_breaker.failure_threshold == defaults.FAILURE_THRESHOLD == 5
    assert settings.circuit_breaker.break_duration == timedelta(seconds=30)
    assert settings.circuit_breaker.half_open_max_probes == 1
    assert settings.circuit_breaker.on_store_unavailable == "allow"
    assert settings.idempotency.enabled is True
    assert settings.singleton_execution.enabled is False
    assert settings.singleton_execution.lease_duration == timedelta(seconds=60)
    assert settings.run_reconciliation.enabled is False
    assert settings.run_continuation.max_attempts == 1
    assert settings.workflows.max_resume_attempts == 1
    assert settings.async_run.max_attempts == 1
    assert settings.agent_graph.cost_limit is None
    assert settings.agent_graph.duration_limit is None
    assert settings.drain.timeout == timedelta(seconds=30)
    assert settings.tool_loop.allow_concurrent_tool_calls is False
    assert settings.retention.idempotency_retention is None
    assert settings.runs.requeue_after == timedelta(seconds=60)
    assert settings.runs.buffered_wait_timeout == timedelta(minutes=10)
    assert settings.runs.max_turns == 16
    assert settings.worker.concurrency == 16
    assert settings.worker.prefetch_multiplier == 1
    assert settings.database.url == "sqlite:///var/tracon.db"
    assert settings.redis.url == "redis://127.0.0.1:6379/0"
    assert settings.pricing.currency == "USD"
    assert (settings.providers, settings.agents, settings.tool_modules) == ({}, {}, [])


# --- finding the file ----------------------------------------------------------------------


def test_tracon_json_in_the_working_directory_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_config(tmp_path, {"Drain": {"Enabled": True}})
    monkeypatch.chdir(tmp_path)

    assert load_settings(environ={}).drain.enabled is True


def test_tracon_config_names_the_file(tmp_path: Path) -> None:
    path = write_config(tmp_path, {"Drain": {"Enabled": True}})

    assert load_settings(environ={"TRACON_CONFIG": str(path)}).drain.enabled is True


@pytest.mark.parametrize("via_environment", [False, True])
def test_a_missing_named_file_fails_naming_tracon_config(
    tmp_path: Path, via_environment: bool
) -> None:
    missing = str(tmp_path / "nope.json")

    with pytest.raises(ConfigurationError) as raised:
        if via_environment:
            load_settings(environ={"TRACON_CONFIG": missing})
        else:
            load_settings(missing, environ={})

    assert raised.value.setting == "TRACON_CONFIG"
    assert "nope.json" in raised.value.rule


def test_a_file_without_the_tracon_root_fails(tmp_path: Path) -> None:
    path = tmp_path / "tracon.json"
    path.write_text('{"CircuitBreaker": {"FailureThreshold": 3}}', encoding="utf-8")

    with pytest.raises(ConfigurationError) as raised:
        load_settings(path, environ={})

    assert raised.value.setting == "Tracon"
    assert "root" in raised.value.rule


def test_a_file_that_is_not_json_fails_naming_the_line(tmp_path: Path) -> None:
    path = tmp_path / "tracon.json"
    path.write_text('{"Tracon": {\n  "Drain": }', encoding="utf-8")

    with pytest.raises(ConfigurationError, match="line 2") as raised:
        load_settings(path, environ={})

    assert raised.value.setting == "TRACON_CONFIG"


def test_other_roots_of_the_file_are_ignored(tmp_path: Path) -> None:
    path = write_config(tmp_path, {"Drain": {"Enabled": True}}, Logging={"LogLevel": "Debug"})

    assert load_settings(path, environ={}).drain.enabled is True


# --- validation rules ----------------------------------------------------------------------

INVALID: list[tuple[dict[str, Any], str, str]] = [
    ({"CircuitBreaker": {"FailureThreshold": 0}}, "CircuitBreaker.FailureThreshold", "at least 1"),
    ({"CircuitBreaker": {"BreakDuration": "00:00:00"}}, "CircuitBreaker.BreakDuration", "positive"),
    ({"CircuitBreaker": {"BreakDuration": -5}}, "CircuitBreaker.BreakDuration", "positive"),
    (
        {"CircuitBreaker": {"HalfOpenMaxProbes": 0}},
        "CircuitBreaker.HalfOpenMaxProbes",
        "at least 1",
    ),
    (
        {"CircuitBreaker": {"OnStoreUnavailable": "maybe"}},
        "CircuitBreaker.OnStoreUnavailable",
        "one of 'allow' or 'reject'",
    ),
    ({"Idempotency": {"MaxKeyLength": 0}}, "Idempotency.MaxKeyLength", "at least 1"),
    (
        {"SingletonExecution": {"LeaseDuration": "00:00:00"}},
        "SingletonExecution.LeaseDuration",
        "positive",
    ),
    (
        {"SingletonExecution": {"LeaseDuration": "50.00:00:00"}},
        "SingletonExecution.LeaseDuration",
        "49.7 days",
    ),
    (
        {"RunReconciliation": {"HeartbeatInterval": "00:00:00"}},
        "RunReconciliation.HeartbeatInterval",
        "between 1 ms and about 49.7 days",
    ),
    (
        {
            "RunReconciliation": {
                "HeartbeatInterval": "50.00:00:00",
                "OrphanThreshold": "60.00:00:00",
            }
        },
        "RunReconciliation.HeartbeatInterval",
        "between 1 ms and about 49.7 days",
    ),
    (
        {"RunReconciliation": {"OrphanThreshold": "00:00:00"}},
        "RunReconciliation.OrphanThreshold",
        "positive",
    ),
    (
        {"RunReconciliation": {"OrphanThreshold": "00:00:29.999"}},
        "RunReconciliation.OrphanThreshold",
        "at least RunReconciliation.HeartbeatInterval",
    ),
    (
        {"RunReconciliation": {"ScanInterval": 0.0005}},
        "RunReconciliation.ScanInterval",
        "between 1 ms and about 49.7 days",
    ),
    (
        {"RunReconciliation": {"ScanInterval": "49.17:02:47.295"}},
        "RunReconciliation.ScanInterval",
        "between 1 ms and about 49.7 days",
    ),
    ({"RunReconciliation": {"MaxRunsPerScan": 0}}, "RunReconciliation.MaxRunsPerScan", "positive"),
    ({"RunContinuation": {"MaxAttempts": -1}}, "RunContinuation.MaxAttempts", "at least 0"),
    (
        {"Workflows": {"ResumeInterruptedRuns": True}},
        "Workflows.ResumeInterruptedRuns",
        "requires Workflows.EnableCheckpointing",
    ),
    ({"Workflows": {"MaxResumeAttempts": -1}}, "Workflows.MaxResumeAttempts", "between 0 and 100"),
    ({"Workflows": {"MaxResumeAttempts": 101}}, "Workflows.MaxResumeAttempts", "between 0 and 100"),
    ({"AsyncRun": {"MaxAttempts": 0}}, "AsyncRun.MaxAttempts", "at least 1"),
    (
        {"ModelConcurrency": {"MaxConcurrentCallsPerProvider": 0}},
        "ModelConcurrency.MaxConcurrentCallsPerProvider",
        "positive",
    ),
    ({"Drain": {"Timeout": "00:00:00"}}, "Drain.Timeout", "positive"),
    ({"Retention": {"Idempotency": 0}}, "Retention.Idempotency", "positive"),
    ({"Runs": {"RequeueAfter": 0}}, "Runs.RequeueAfter", "positive"),
    ({"Runs": {"BufferedWaitTimeout": "-00:00:01"}}, "Runs.BufferedWaitTimeout", "positive"),
    ({"Runs": {"MaxTurns": 0}}, "Runs.MaxTurns", "at least 1"),
    ({"Worker": {"Concurrency": 0}}, "Worker.Concurrency", "at least 1"),
    ({"Worker": {"PrefetchMultiplier": 0}}, "Worker.PrefetchMultiplier", "at least 1"),
    ({"Database": {"Url": " "}}, "Database.Url", "must not be empty"),
    ({"Providers": {"p": {}}}, "Providers.p.Kind", "is required"),
    ({"Providers": {"p": {"Kind": "gemini"}}}, "Providers.p.Kind", "must be one of"),
    (
        {"Providers": {"p": {"Kind": "openai", "TimeoutSeconds": 0}}},
        "Providers.p.TimeoutSeconds",
        "positive",
    ),
    (
        {"Providers": {"p": {"Kind": "scripted", "Script": [{"Text": "a"}, {}]}}},
        "Providers.p.Script[1]",
        "must set Text, ToolCalls or ErrorStatus",
    ),
    (
        {"Providers": {"p": {"Kind": "scripted", "Script": [{"Text": "a", "DelaySeconds": -1}]}}},
        "Providers.p.Script[0].DelaySeconds",
        "at least 0",
    ),
    (
        {"Pricing": {"Models": {"m": {"InputPerMillion": -1, "OutputPerMillion": 1}}}},
        "Pricing.Models.m.InputPerMillion",
        "at least 0",
    ),
    (
        {"Pricing": {"Models": {"m": {"InputPerMillion": 1}}}},
        "Pricing.Models.m.OutputPerMillion",
        "required",
    ),
    (with_agent(Temperature=2.5), "Agents.a.Model.Temperature", "between 0 and 2"),
    (with_agent(topP=1.5), "Agents.a.Model.TopP", "between 0 and 1"),
    (with_agent(maxOutputTokens=0), "Agents.a.Model.MaxOutputTokens", "at least 1"),
    (with_agent(Provider="nope"), "Agents.a.Model.Provider", "configured provider"),
    (
        with_agent(fallbacks=[{"provider": "p", "model": "m2"}, {"provider": "x", "model": "y"}]),
        "Agents.a.Model.Fallbacks[1].Provider",
        "configured provider",
    ),
    ({**PROVIDER, "Agents": {"a": {"Instructions": "hi"}}}, "Agents.a.Model", "is required"),
    (
        {
            **with_agent(
                ResponseFormat={"type": "json_object"},
                Fallbacks=[{"Provider": "c", "Model": "claude"}],
            ),
            "Providers": {"p": PROVIDER["Providers"]["p"], "c": {"Kind": "anthropic"}},
        },
        "Agents.a.Model.ResponseFormat",
        "json_schema or text (got type 'json_object'); the agent's Model.Fallbacks[0].Provider",
    ),
    (
        {
            **with_agent(Provider="c", Temperature=1.5),
            "Providers": {"c": {"Kind": "anthropic"}},
        },
        "Agents.a.Model.Temperature",
        "between 0 and 1 (got 1.5); the agent's Model.Provider is 'c', an anthropic provider",
    ),
    (
        {"CircuitBreaker": {"FailureThreshold": "many"}},
        "CircuitBreaker.FailureThreshold",
        "whole number",
    ),
    (
        {"CircuitBreaker": {"FailureThreshold": True}},
        "CircuitBreaker.FailureThreshold",
        "whole number",
    ),
    ({"CircuitBreaker": {"Enabled": "maybe"}}, "CircuitBreaker.Enabled", "true or false"),
    (
        {"CircuitBreaker": {"BreakDuration": "30 seconds"}},
        "CircuitBreaker.BreakDuration",
        "hh:mm:ss",
    ),
    ({"CircuitBreaker": 5}, "CircuitBreaker", "must be an object"),
    ({"ToolModules": "tools"}, "ToolModules", "must be a list"),
    ({"CircuitBreaker": {"FailureTreshold": 3}}, "CircuitBreaker.FailureTreshold", "not a known"),
    ({"Logging": {}}, "Logging", "not a known setting"),
    (
        {"CircuitBreaker": {"FailureThreshold": 3, "failure_threshold": 4}},
        "CircuitBreaker.FailureThreshold",
        "twice",
    ),
]


@pytest.mark.parametrize(("tracon", "setting", "rule"), INVALID, ids=[case[1] for case in INVALID])
def test_an_invalid_value_fails_naming_the_setting_and_the_rule(
    tmp_path: Path, tracon: dict[str, Any], setting: str, rule: str
) -> None:
    with pytest.raises(ConfigurationError) as raised:
        load(tmp_path, tracon)

    assert raised.value.setting == setting
    assert rule in raised.value.rule
    assert str(raised.value) == f"Invalid configuration: {setting}: {raised.value.rule}"


def test_a_rule_message_quotes_the_bad_value(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError) as raised:
        load(tmp_path, {"CircuitBreaker": {"FailureThreshold": 0, "BreakDuration": 0}})

    assert raised.value.rule == "must be at least 1 (got 0)"

    with pytest.raises(ConfigurationError) as raised:
        load(tmp_path, {"CircuitBreaker": {"BreakDuration": 0}})

    assert raised.value.rule == "must be positive (got 00:00:00)"


VALID: list[tuple[dict[str, Any], Callable[[Settings], object], object]] = [
    ({"CircuitBreaker": {"FailureThreshold": 1}}, lambda s: s.circuit_breaker.failure_threshold, 1),
    (
        {"CircuitBreaker": {"HalfOpenMaxProbes": 1}},
        lambda s: s.circuit_breaker.half_open_max_probes,
        1,
    ),
    (
        {"CircuitBreaker": {"OnStoreUnavailable": "reject"}},
        lambda s: s.circuit_breaker.on_store_unavailable,
        "reject",
    ),
    (
        {"CircuitBreaker": {"BreakDuration": 0.001}},
        lambda s: s.circuit_breaker.break_duration,
        timedelta(milliseconds=1),
    ),
    ({"Idempotency": {"MaxKeyLength": 1}}, lambda s: s.idempotency.max_key_length, 1),
    (
        {"SingletonExecution": {"LeaseDuration": "49.17:02:47.294"}},
        lambda s: s.singleton_execution.lease_duration,
        MAX_TIMER,
    ),
    (
        {"RunReconciliation": {"HeartbeatInterval": "00:00:00.001"}},
        lambda s: s.run_reconciliation.heartbeat_interval,
        timedelta(milliseconds=1),
    ),
    (
        {"RunReconciliation": {"HeartbeatInterval": "00:01:00", "OrphanThreshold": "00:01:00"}},
        lambda s: s.run_reconciliation.orphan_threshold,
        timedelta(minutes=1),
    ),
    (
        {"RunReconciliation": {"ScanInterval": "49.17:02:47.294"}},
        lambda s: s.run_reconciliation.scan_interval,
        MAX_TIMER,
    ),
    (
        {"RunReconciliation": {"MaxRunsPerScan": 1}},
        lambda s: s.run_reconciliation.max_runs_per_scan,
        1,
    ),
    ({"RunContinuation": {"MaxAttempts": 0}}, lambda s: s.run_continuation.max_attempts, 0),
    ({"Workflows": {"MaxResumeAttempts": 0}}, lambda s: s.workflows.max_resume_attempts, 0),
    ({"Workflows": {"MaxResumeAttempts": 100}}, lambda s: s.workflows.max_resume_attempts, 100),
    (
        {"Workflows": {"EnableCheckpointing": True, "ResumeInterruptedRuns": True}},
        lambda s: s.workflows.resume_interrupted_runs,
        True,
    ),
    ({"AsyncRun": {"MaxAttempts": 1}}, lambda s: s.async_run.max_attempts, 1),
    (
        {"ModelConcurrency": {"MaxConcurrentCallsPerProvider": 1}},
        lambda s: s.model_concurrency.max_concurrent_calls_per_provider,
        1,
    ),
    (with_agent(Temperature=0), lambda s: s.agents["a"].model.temperature, 0),
    (with_agent(Temperature=2), lambda s: s.agents["a"].model.temperature, 2),
    (with_agent(TopP=0), lambda s: s.agents["a"].model.top_p, 0),
    (with_agent(TopP=1), lambda s: s.agents["a"].model.top_p, 1),
    ({"Providers": {"p": {"Kind": "openai"}}}, lambda s: s.providers["p"].script, []),
    (
        {"Pricing": {"Models": {"m": {"InputPerMillion": 0, "OutputPerMillion": "0.6"}}}},
        lambda s: s.pricing.models["m"].output_per_million,
        Decimal("0.6"),
    ),
]


@pytest.mark.parametrize(("tracon", "read", "expected"), VALID)
def test_a_boundary_value_is_accepted(
    tmp_path: Path, tracon: dict[str, Any], read: Callable[[Settings], object], expected: object
) -> None:
    assert read(load(tmp_path, tracon)) == expected


# --- AgentGraph: zero and negative have a meaning ------------------------------------------


def test_agent_graph_zero_and_negative_values_clamp_or_remove_the_limit(tmp_path: Path) -> None:
    graph = load(
        tmp_path,
        {
            "AgentGraph": {
                "MaxDepth": -1,
                "MaxTotalTokens": 0,
                "MaxTotalRuns": -5,
                "MaxDuration": "00:00:00",
                "MaxTotalCost": 0,
            }
        },
    ).agent_graph

    assert (graph.max_depth, graph.max_total_runs) == (-1, -5)  # what the operator wrote
    assert graph.depth_limit == 0
    assert graph.token_limit is None
    assert graph.run_limit is None
    assert graph.duration_limit is None
    assert graph.cost_limit is None


def test_agent_graph_negative_durations_and_costs_remove_the_limit(tmp_path: Path) -> None:
    graph = load(tmp_path, {"AgentGraph": {"MaxDuration": -1, "MaxTotalCost": "-0.5"}}).agent_graph

    assert graph.max_duration == timedelta(seconds=-1)
    assert graph.duration_limit is None
    assert graph.cost_limit is None


def test_agent_graph_positive_values_are_limits(tmp_path: Path) -> None:
    tracon = {
        "AgentGraph": {"MaxDuration": "00:10:00", "MaxTotalCost": 1.25, "MaxTotalTokens": None}
    }

    graph = load(tmp_path, tracon).agent_graph

    assert graph.duration_limit == timedelta(minutes=10)
    assert graph.cost_limit == Decimal("1.25")
    assert graph.token_limit is None


# --- durations -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("00:00:30", timedelta(seconds=30)),
        ("00:05:00", timedelta(minutes=5)),
        ("00:00:00.001", timedelta(milliseconds=1)),
        ("1.02:03:04.5", timedelta(days=1, hours=2, minutes=3, seconds=4.5)),
        ("1.02:03:04", timedelta(days=1, hours=2, minutes=3, seconds=4)),
        (30, timedelta(seconds=30)),
        ("30", timedelta(seconds=30)),
        ("0.5", timedelta(milliseconds=500)),
        (0.25, timedelta(milliseconds=250)),
        ("-00:00:01", timedelta(seconds=-1)),
        (-1, timedelta(seconds=-1)),
        (timedelta(hours=1), timedelta(hours=1)),
    ],
)
def test_duration_forms(value: str | int | float | timedelta, expected: timedelta) -> None:
    assert parse_duration(value) == expected


@pytest.mark.parametrize(
    "value", ["", "abc", "30s", "1:00", "00:60:00", "24:00:00", "1.2.3", "nan", "PT30S", True]
)
def test_bad_durations_are_rejected(value: Any) -> None:
    with pytest.raises(ValueError, match="hh:mm:ss"):
        parse_duration(value)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), 1e300])
def test_non_finite_durations_are_rejected(value: float) -> None:
    with pytest.raises(ValueError, match="not finite or out of range"):
        parse_duration(value)


def test_durations_format_as_the_file_writes_them() -> None:
    assert format_duration(timedelta(seconds=30)) == "00:00:30"
    assert format_duration(timedelta(days=1, hours=2, milliseconds=500)) == "1.02:00:00.500"
    assert format_duration(timedelta(seconds=-1)) == "-00:00:01"
    assert format_duration(MAX_TIMER) == "49.17:02:47.294"
    assert parse_duration(format_duration(MAX_TIMER)) == MAX_TIMER


# --- keys in any case, and the environment -------------------------------------------------


@pytest.mark.parametrize(
    "key", ["FailureThreshold", "failureThreshold", "failurethreshold", "failure_threshold"]
)
def test_file_keys_match_in_any_case(tmp_path: Path, key: str) -> None:
    settings = load(tmp_path, {"circuit_breaker": {key: 2}, "RUNRECONCILIATION": {"enabled": True}})

    assert settings.circuit_breaker.failure_threshold == 2
    assert settings.run_reconciliation.enabled is True


def test_an_environment_override_beats_the_file(tmp_path: Path) -> None:
    settings = load(
        tmp_path,
        {"CircuitBreaker": {"FailureThreshold": 5, "Enabled": False}},
        TRACON__CIRCUITBREAKER__FAILURETHRESHOLD="3",
        tracon__circuit_breaker__break_duration="00:01:00",
    )

    assert settings.circuit_breaker.failure_threshold == 3
    assert settings.circuit_breaker.break_duration == timedelta(minutes=1)
    assert settings.circuit_breaker.enabled is False  # untouched by the override


def test_an_invalid_environment_value_names_the_setting(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError) as raised:
        load(tmp_path, {}, TRACON__CIRCUITBREAKER__FAILURETHRESHOLD="0")

    assert raised.value.setting == "CircuitBreaker.FailureThreshold"


def test_environment_keys_merge_into_user_named_entries_and_keep_new_names(tmp_path: Path) -> None:
    tracon = with_agent(Model="m1")

    settings = load(
        tmp_path,
        tracon,
        TRACON__AGENTS__A__MODEL__MODEL="gpt-x",
        TRACON__AGENTS__Billing__MODEL='{"provider": "p", "model": "m2"}',
    )

    assert set(settings.agents) == {"a", "Billing"}
    assert settings.agents["a"].model.model == "gpt-x"
    assert settings.agents["Billing"].model.model == "m2"


def test_a_json_list_environment_value(tmp_path: Path) -> None:
    settings = load(tmp_path, {}, TRACON__TOOLMODULES='["app.tools", "app.more_tools"]')

    assert settings.tool_modules == ["app.tools", "app.more_tools"]


def test_a_json_object_environment_value_merges_into_the_file(tmp_path: Path) -> None:
    settings = load(
        tmp_path,
        {"Drain": {"Enabled": True, "Timeout": "00:00:10"}},
        TRACON__DRAIN='{"timeout": "00:00:20"}',
    )

    assert settings.drain.enabled is True
    assert settings.drain.timeout == timedelta(seconds=20)


def test_null_in_the_environment_clears_a_value(tmp_path: Path) -> None:
    settings = load(tmp_path, {}, TRACON__AGENTGRAPH__MAXTOTALTOKENS="null")

    assert settings.agent_graph.max_total_tokens is None


def test_malformed_json_in_the_environment_names_the_variable(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError) as raised:
        load(tmp_path, {}, TRACON__TOOLMODULES='["a",')

    assert raised.value.setting == "TRACON__TOOLMODULES"


def test_database_and_redis_url_shortcuts(tmp_path: Path) -> None:
    settings = load(
        tmp_path,
        {"Database": {"Url": "sqlite:///file.db"}},
        TRACON_DATABASE_URL="postgresql+psycopg://db/tracon",
        TRACON_REDIS_URL="redis://cache:6379/1",
    )

    assert settings.database.url == "postgresql+psycopg://db/tracon"
    assert settings.redis.url == "redis://cache:6379/1"


def test_the_section_form_wins_over_the_url_shortcut(tmp_path: Path) -> None:
    settings = load(
        tmp_path,
        {},
        TRACON_DATABASE_URL="postgresql+psycopg://shortcut/tracon",
        TRACON__DATABASE__URL="postgresql+psycopg://section/tracon",
    )

    assert settings.database.url == "postgresql+psycopg://section/tracon"


# --- providers, agents, pricing ------------------------------------------------------------


def test_agents_keep_user_chosen_keys(tmp_path: Path) -> None:
    tracon = {
        "Providers": {"OpenAI-Main": {"Kind": "openai", "BaseUrl": "http://llm:8000/v1"}},
        "Agents": {
            "Support_Bot": {
                "instructions": "Be brief.",
                "model": {
                    "provider": "OpenAI-Main",
                    "model": "gpt-5.4-mini",
                    "responseFormat": {"type": "json_schema", "Json_Schema": {}},
                },
                "tools": ["lookup_order"],
                "parameters": {"Customer_Id": {"type": "string"}},
            }
        },
    }

    agent = load(tmp_path, tracon).agents["Support_Bot"]

    assert agent.model.provider == "OpenAI-Main"
    assert agent.model.response_format == {"type": "json_schema", "Json_Schema": {}}
    assert agent.parameters == {"Customer_Id": {"type": "string"}}
    assert agent.tools == ["lookup_order"]


def test_a_scripted_provider_reads_its_steps(tmp_path: Path) -> None:
    step = {"toolCalls": [{"name": "lookup", "arguments": {"Order_Id": 7}}], "delaySeconds": 0.1}
    tracon = {"Providers": {"fake": {"Kind": "scripted", "Script": [step, {"ErrorStatus": 503}]}}}

    script = load(tmp_path, tracon).providers["fake"].script

    assert script[0].tool_calls[0].arguments == {"Order_Id": 7}
    assert (script[0].input_tokens, script[0].output_tokens) == (10, 5)
    assert script[1].error_status == 503


def test_the_api_key_never_shows(tmp_path: Path) -> None:
    tracon = {"Providers": {"p": {"Kind": "openai", "ApiKey": "sk-very-secret"}}}

    settings = load(tmp_path, tracon)

    assert "sk-very-secret" not in repr(settings)
    assert "sk-very-secret" not in str(settings)
    assert "sk-very-secret" not in json.dumps(settings.model_dump(mode="json", by_alias=True))
    assert settings.providers["p"].resolved_api_key({}) == "sk-very-secret"


def test_a_wrongly_typed_api_key_is_not_quoted(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError) as raised:
        load(tmp_path, {"Providers": {"p": {"Kind": "openai", "ApiKey": 987654321}}})

    assert raised.value.setting == "Providers.p.ApiKey"
    assert "987654321" not in str(raised.value)


def test_the_api_key_can_come_from_a_named_variable(tmp_path: Path) -> None:
    tracon = {"Providers": {"p": {"Kind": "openai", "ApiKeyEnv": "P_KEY"}}}
    settings = load(tmp_path, tracon, P_KEY="")  # unset fails at startup: test_settings_strict
    provider = settings.providers["p"]

    assert provider.resolved_api_key({"P_KEY": "sk-env"}) == "sk-env"
    assert provider.resolved_api_key({}) is None


def test_price_for_a_configured_model(tmp_path: Path) -> None:
    tracon = {
        "Pricing": {
            "Currency": "EUR",
            "Models": {"gpt-5.4-mini": {"InputPerMillion": "0.15", "OutputPerMillion": "0.6"}},
        }
    }

    pricing = load(tmp_path, tracon).pricing

    price = pricing.price_for("gpt-5.4-mini")
    assert price is not None and price.input_per_million == Decimal("0.15")
    assert pricing.price_for("unpriced") is None
    assert pricing.currency == "EUR"


# --- the rest of the surface ---------------------------------------------------------------


def test_retention_reports_its_period_only_when_enabled(tmp_path: Path) -> None:
    on = load(tmp_path, {"Retention": {"Enabled": True}}).retention
    shorter = load(tmp_path, {"Retention": {"Enabled": True, "Idempotency": "06:00:00"}}).retention

    assert on.idempotency_retention == timedelta(days=1)
    assert shorter.idempotency_retention == timedelta(hours=6)


def test_a_generated_owner_id_is_stable_per_instance(tmp_path: Path) -> None:
    singleton = load(tmp_path, {}).singleton_execution

    owner = singleton.resolved_owner_id()

    host, pid, suffix = owner.split("/")
    assert host and pid.isdigit() and len(suffix) == 8
    assert singleton.resolved_owner_id() == owner
    assert load(tmp_path, {}).singleton_execution.resolved_owner_id() != owner
    assert singleton == load(tmp_path, {}).singleton_execution  # not part of the configuration


def test_a_configured_owner_id_is_used_as_is(tmp_path: Path) -> None:
    settings = load(tmp_path, {"SingletonExecution": {"OwnerId": "beat-1"}})

    assert settings.singleton_execution.resolved_owner_id() == "beat-1"


def test_settings_are_immutable() -> None:
    settings = Settings()

    with pytest.raises(ValueError, match="frozen"):
        settings.circuit_breaker.failure_threshold = 1  # type: ignore[misc]


def test_the_public_dump_loads_back_to_the_same_settings(tmp_path: Path) -> None:
    original = load(tmp_path, {"AgentGraph": {"MaxDuration": "00:02:00"}, **with_agent(TopP=0.5)})

    dumped = original.model_dump(mode="json", by_alias=True)

    assert dumped["AgentGraph"]["MaxDuration"] == "00:02:00"
    assert load(tmp_path, dumped) == original
