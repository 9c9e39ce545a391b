"""`tracon-jobs schedules ...` against real SQL: create (the API's rules, each broken one
naming its option), list, show, pause, resume, fires and delete, by id or by name."""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import pytest

from tests.helpers import MakeRuntime, scripted_agent
from tracon_jobs.cli import main
from tracon_jobs.runtime import Runtime


@pytest.fixture
def runtime(
    make_runtime: MakeRuntime,
    sql_url: str,
    redis_url: str,
    write_config: Callable[..., Path],
    monkeypatch: pytest.MonkeyPatch,
) -> Runtime:
    sections = scripted_agent([{"Text": "ok"}])
    path = write_config(Database={"Url": sql_url}, Redis={"Url": redis_url}, **sections)
    monkeypatch.setenv("TRACON_CONFIG", str(path))
    rt = make_runtime(sql_url, sender=lambda _run_id: None, **sections)
    rt.tenants.ensure_tenant("acme")
    return rt


def test_create_list_show_pause_resume_fires_delete(
    runtime: Runtime, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["schedules", "create", "tick", "--tenant", "acme", "--interval", "PT1M"]
    assert main([*args, "--agent", "demo", "--message", "hi", "--overlap", "queue"]) == 0
    assert capsys.readouterr().out.startswith("schedule ")

    assert main(["schedules", "list", "--tenant", "acme"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert len(listed) == 2 and "tick" in listed[1] and "every 60s" in listed[1]

    assert main(["schedules", "show", "tick", "--tenant", "acme"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert (shown["interval"], shown["overlap"], shown["target"]) == (
        60,
        "queue",
        {"agent": "demo"},
    )

    assert main(["schedules", "pause", "tick", "--tenant", "acme"]) == 0
    assert main(["schedules", "resume", shown["id"], "--tenant", "acme"]) == 0
    capsys.readouterr()
    again = runtime.schedules.get(runtime.tenants.find_tenant("acme") or "", shown["id"])
    assert again.next_fire_at is not None
    runtime.schedule_firing.scan_once(again.next_fire_at + timedelta(seconds=1))

    assert main(["schedules", "fires", "tick", "--tenant", "acme"]) == 0
    fires = capsys.readouterr().out.splitlines()
    assert len(fires) == 2 and " fired " in fires[1]

    assert main(["schedules", "delete", "tick", "--tenant", "acme"]) == 0
    capsys.readouterr()
    assert main(["schedules", "show", "tick", "--tenant", "acme"]) == 1
    assert "no schedule 'tick'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("options", "words"),
    [
        (["--cron", "61 * * * *", "--agent", "demo", "--message", "m"], "--cron: minute: 61"),
        (["--interval", "60", "--agent", "nobody", "--message", "m"], "--agent/--workflow: must"),
        (["--interval", "0.1", "--agent", "demo", "--message", "m"], "--interval: must be"),
        (["--cron", "@daily", "--timezone", "Nowhere", "--agent", "demo"], "--timezone: "),
        (["--interval", "60", "--agent", "demo"], "--input: an agent's input needs"),
        (["--interval", "60"], "exactly one of --agent and --workflow"),
    ],
)
def test_create_holds_the_options_to_the_apis_rules(
    runtime: Runtime, capsys: pytest.CaptureFixture[str], options: list[str], words: str
) -> None:
    assert main(["schedules", "create", "s", "--tenant", "acme", *options]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and words in captured.err, captured.err
