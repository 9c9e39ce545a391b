"""Strict configuration: booleans are `true` or `false` only, an `ApiKeyEnv` must name a set
variable, an error from an environment variable names the variable, and an unknown key close
to a known one gets "did you mean"."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from tracon_jobs.errors import ConfigurationError
from tracon_jobs.settings import ConfigModel, Settings, load_settings


def load(tmp_path: Path, tracon: Mapping[str, Any], **environ: str) -> Settings:
    path = tmp_path / "tracon.json"
    path.write_text(json.dumps({"Tracon": tracon}))
    return load_settings(path, environ=environ)


def failure(tmp_path: Path, tracon: Mapping[str, Any], **environ: str) -> ConfigurationError:
    with pytest.raises(ConfigurationError) as raised:
        load(tmp_path, tracon, **environ)
    return raised.value


# -- booleans ------------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["yes", 0, 1, "true", "False", "on", "", None, 0.0])
def test_a_boolean_in_the_file_is_json_true_or_false_only(tmp_path: Path, value: Any) -> None:
    """Before: `"yes"`, `0`, `1` and `"true"` were taken (pydantic's lax booleans)."""
    error = failure(tmp_path, {"CircuitBreaker": {"Enabled": value}})

    assert error.setting == "CircuitBreaker.Enabled"
    assert error.rule.startswith("must be true or false")
    assert f"(got {json.dumps(value)})" in error.rule


@pytest.mark.parametrize(
    ("section", "key"),
    [
        ("Idempotency", "Enabled"),
        ("SingletonExecution", "Enabled"),
        ("RunReconciliation", "Enabled"),
        ("RunContinuation", "Enabled"),
        ("Workflows", "EnableCheckpointing"),
        ("Workflows", "ResumeInterruptedRuns"),
        ("Drain", "Enabled"),
        ("ToolLoop", "AllowConcurrentToolCalls"),
        ("Retention", "Enabled"),
    ],
)
def test_every_boolean_setting_is_strict(tmp_path: Path, section: str, key: str) -> None:
    error = failure(tmp_path, {section: {key: "yes"}})

    assert error.setting == f"{section}.{key}"
    assert "must be true or false" in error.rule


@pytest.mark.parametrize("value", [True, False])
def test_json_booleans_load(tmp_path: Path, value: bool) -> None:
    assert load(tmp_path, {"Drain": {"Enabled": value}}).drain.enabled is value


@pytest.mark.parametrize(
    ("text", "expected"), [("true", True), ("FALSE", False), ("True", True), (" false ", False)]
)
def test_an_environment_variable_may_write_a_boolean_as_text(
    tmp_path: Path, text: str, expected: bool
) -> None:
    settings = load(tmp_path, {}, TRACON__DRAIN__ENABLED=text)

    assert settings.drain.enabled is expected


@pytest.mark.parametrize("text", ["yes", "1", "0", "on"])
def test_other_environment_text_is_no_boolean_and_names_the_variable(
    tmp_path: Path, text: str
) -> None:
    error = failure(tmp_path, {}, TRACON__DRAIN__ENABLED=text)

    assert error.setting == "Drain.Enabled"
    assert "must be true or false" in error.rule
    assert "environment variable TRACON__DRAIN__ENABLED" in error.rule


def test_a_string_setting_from_the_environment_may_read_true(tmp_path: Path) -> None:
    settings = load(tmp_path, {}, TRACON__SINGLETONEXECUTION__OWNERID="true")

    assert settings.singleton_execution.owner_id == "true"
    assert type(settings.singleton_execution.owner_id) is str


# -- ApiKeyEnv -----------------------------------------------------------------------------


def test_an_api_key_env_naming_an_unset_variable_fails_at_startup(tmp_path: Path) -> None:
    """Before: the client was built with a placeholder key and every call failed later."""
    tracon = {"Providers": {"openai": {"Kind": "openai", "ApiKeyEnv": "MY_OPENAI_KEY"}}}

    error = failure(tmp_path, tracon)

    assert error.setting == "Providers.openai.ApiKeyEnv"
    assert "MY_OPENAI_KEY" in error.rule and "not set" in error.rule
    assert "Providers.openai.ApiKeyEnv" in str(error) and "MY_OPENAI_KEY" in str(error)


def test_an_api_key_env_naming_a_set_variable_loads(tmp_path: Path) -> None:
    tracon = {"Providers": {"openai": {"Kind": "openai", "ApiKeyEnv": "MY_OPENAI_KEY"}}}

    settings = load(tmp_path, tracon, MY_OPENAI_KEY="sk-1")

    assert settings.providers["openai"].resolved_api_key({"MY_OPENAI_KEY": "sk-1"}) == "sk-1"
    # set but empty: a local server that needs no key (compose passes `${OPENAI_API_KEY:-}`)
    assert load(tmp_path, tracon, MY_OPENAI_KEY="").providers["openai"].api_key_env


def test_an_inline_api_key_wins_over_an_unset_variable(tmp_path: Path) -> None:
    provider = {"Kind": "openai", "ApiKey": "sk-inline", "ApiKeyEnv": "UNSET_KEY"}

    settings = load(tmp_path, {"Providers": {"p": provider}})

    assert settings.providers["p"].resolved_api_key({}) == "sk-inline"


# -- errors name their environment variable ------------------------------------------------


@pytest.mark.parametrize(
    ("environ", "setting", "variable"),
    [
        (
            {"TRACON__CIRCUITBREAKER__FAILURETHRESHOLD": "zero"},
            "CircuitBreaker.FailureThreshold",
            "TRACON__CIRCUITBREAKER__FAILURETHRESHOLD",
        ),
        (
            {"tracon__CircuitBreaker__BreakDuration": "-5"},
            "CircuitBreaker.BreakDuration",
            "tracon__CircuitBreaker__BreakDuration",
        ),
        ({"TRACON_REDIS_URL": " "}, "Redis.Url", "TRACON_REDIS_URL"),
        (
            {"TRACON__AGENTS": '{"a": {"Model": {"Provider": "p", "Model": "m", "TopP": 3}}}'},
            "Agents.a.Model.TopP",
            "TRACON__AGENTS",
        ),
    ],
)
def test_an_error_from_an_environment_variable_names_it(
    tmp_path: Path, environ: dict[str, str], setting: str, variable: str
) -> None:
    tracon = {"Providers": {"p": {"Kind": "scripted", "Script": [{"Text": "hi"}]}}}

    error = failure(tmp_path, tracon, **environ)

    assert error.setting == setting
    assert error.rule.endswith(f"(from environment variable {variable})")


def test_an_error_in_the_file_names_no_variable(tmp_path: Path) -> None:
    error = failure(
        tmp_path, {"CircuitBreaker": {"FailureThreshold": 0}}, TRACON__DRAIN__ENABLED="true"
    )

    assert error.setting == "CircuitBreaker.FailureThreshold"
    assert "environment variable" not in error.rule


# -- did you mean --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tracon", "setting", "meant"),
    [
        (
            {"CircuitBreaker": {"FailureTreshold": 3}},
            "CircuitBreaker.FailureTreshold",
            "FailureThreshold",
        ),
        ({"CircuitBreacker": {}}, "CircuitBreacker", "CircuitBreaker"),
        ({"Drain": {"Enabeld": True}}, "Drain.Enabeld", "Enabled"),
        ({"Tool_Modules": [], "ToolModule": []}, "ToolModule", "ToolModules"),
    ],
)
def test_an_unknown_key_close_to_a_known_one_gets_did_you_mean(
    tmp_path: Path, tracon: dict[str, Any], setting: str, meant: str
) -> None:
    error = failure(tmp_path, tracon)

    assert error.setting == setting
    assert error.rule == f'is not a known setting; did you mean "{meant}"?'


def test_an_unknown_key_far_from_any_gets_no_guess(tmp_path: Path) -> None:
    error = failure(tmp_path, {"CircuitBreaker": {"Colour": "blue"}})

    assert error.setting == "CircuitBreaker.Colour"
    assert error.rule == "is not a known setting"


def test_did_you_mean_from_an_environment_variable_names_it(tmp_path: Path) -> None:
    error = failure(tmp_path, {}, TRACON__CIRCUITBREAKER__FAILURETRESHOLD="3")

    assert 'did you mean "FailureThreshold"?' in error.rule
    assert "TRACON__CIRCUITBREAKER__FAILURETRESHOLD" in error.rule


def _config_models() -> list[type[ConfigModel]]:
    found: list[type[ConfigModel]] = []
    todo: list[type[ConfigModel]] = [ConfigModel]
    while todo:
        model = todo.pop()
        found.append(model)
        todo += model.__subclasses__()
    return found


def test_no_section_declares_a_lenient_boolean() -> None:
    """A `bool` field must be declared `Flag`, or pydantic takes `"yes"` and `0` again."""
    lenient = []
    for model in _config_models():
        for name, field in model.model_fields.items():
            if field.annotation not in (bool, bool | None):
                continue
            alias = field.alias or name
            try:
                model.model_validate({alias: "yes"})
            except ValidationError as exc:
                if any(error["loc"] == (alias,) for error in exc.errors()):
                    continue
            lenient.append(f"{model.__name__}.{alias}")

    assert lenient == []
