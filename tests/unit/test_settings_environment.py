"""`TRACON_*` variables that configure nothing: which are reported, what each probably meant,
the warning logged once per process, and the list of the variables the project reads held to
the names the code, the tests and the docs spell."""

from __future__ import annotations

import logging
import re
import subprocess
from pathlib import Path

import pytest

from tracon_jobs.settings import ENV_SHORTCUTS, Settings, load_settings
from tracon_jobs.settings.environment import OTHER_VARIABLES, unused_variables

ROOT = Path(__file__).resolve().parents[2]

SCRIPTED = {"Kind": "scripted", "Script": [{"Text": "hi"}]}


def unused(environ: dict[str, str], settings: Settings | None = None) -> dict[str, str | None]:
    return dict(unused_variables(environ, settings or Settings(), ENV_SHORTCUTS))


def test_a_setting_written_with_one_underscore_is_reported_with_its_right_spelling() -> None:
    found = unused({"TRACON_CIRCUITBREAKER__FAILURETHRESHOLD": "0"})

    assert found == {
        "TRACON_CIRCUITBREAKER__FAILURETHRESHOLD": "TRACON__CIRCUITBREAKER__FAILURETHRESHOLD"
    }


@pytest.mark.parametrize(
    ("name", "meant"),
    [
        ("TRACON_LOGLEVEL", "TRACON_LOG_LEVEL"),
        ("tracon_log_level", "TRACON_LOG_LEVEL"),  # names are case-sensitive: read by nothing
        ("TRACON_DATABASE_URLS", "TRACON_DATABASE_URL"),
        ("TRACON_FASTPATHS", "TRACON_FAST_PATHS"),
        ("TRACON_DRAIN__ENABLED", "TRACON__DRAIN__ENABLED"),
        ("TRACON_WORKFLOWMODULES", "TRACON__WORKFLOWMODULES"),
        ("TRACON_ZZZ", None),
    ],
)
def test_a_variable_that_configures_nothing_names_what_it_probably_meant(
    name: str, meant: str | None
) -> None:
    assert unused({name: "1"}) == {name: meant}


def test_settings_the_shortcuts_the_processes_variables_and_named_secrets_are_not_reported() -> (
    None
):
    settings = Settings.model_validate(
        {"Providers": {"p": {**SCRIPTED, "ApiKeyEnv": "TRACON_MY_PROVIDER_KEY"}}}
    )
    environ = {
        "TRACON__CIRCUITBREAKER__FAILURETHRESHOLD": "3",  # a setting
        "tracon__drain__enabled": "true",  # a setting too: the prefix matches in any case
        "TRACON_DATABASE_URL": "sqlite://",
        "TRACON_MY_PROVIDER_KEY": "k",  # named by Providers.p.ApiKeyEnv
        "OTHER_VARIABLE": "x",
        **dict.fromkeys(OTHER_VARIABLES, "1"),
    }

    assert unused(environ, settings) == {}


def test_load_settings_warns_once_per_process_and_still_loads(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = tmp_path / "tracon.json"
    config.write_text('{"Tracon": {}}')
    environ = {"TRACON_RUNS__MAXQUEUEDPERTENANT_ONCE": "3"}  # a name no other test uses

    with caplog.at_level(logging.WARNING, logger="tracon_jobs.settings"):
        first = load_settings(config, environ)
        load_settings(config, environ)

    assert first == Settings()
    [warning] = [r for r in caplog.records if "TRACON_RUNS__MAXQUEUEDPERTENANT_ONCE" in r.message]
    assert warning.levelno == logging.WARNING
    assert "configures nothing" in warning.message
    assert "did you mean TRACON__RUNS__MAXQUEUEDPERTENANT_ONCE?" in warning.message


# -- the list of the project's own variables -----------------------------------------------

SPELLED = re.compile(r"\bTRACON_[A-Z0-9][A-Z0-9_]*")
SELF = ("tracon_jobs/settings/environment.py", "tests/unit/test_settings_environment.py")

NOT_VARIABLES = {
    "TRACON_DRAINING": "a Flask config key of the web app (web/draining.py), no variable",
    "TRACON_CIRCUITBREAKER__FAILURETHRESHOLD": "the mistake the warning is for, in its tests",
    "TRACON_DRAIN__ENABLED": "another such mistake, in the changelog",
}


def spelled_names() -> dict[str, set[str]]:
    """Each single-underscore `TRACON_` name in the checkout's files (committed or not), with
    the files; not the list itself, nor this file, whose names are mistakes on purpose."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    found: dict[str, set[str]] = {}
    for relative in listed:
        path = ROOT / relative
        if not path.is_file() or relative in SELF:
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        for name in SPELLED.findall(text):
            found.setdefault(name.rstrip("_"), set()).add(relative)
    return found


def test_every_variable_the_project_spells_is_listed_and_every_listed_one_is_spelled() -> None:
    found = spelled_names()
    listed = {*OTHER_VARIABLES, *ENV_SHORTCUTS}

    unlisted = {name: files for name, files in found.items() if name not in listed}
    assert set(unlisted) <= set(NOT_VARIABLES), unlisted
    assert [name for name in OTHER_VARIABLES if name not in found] == []  # none stale
