"""The `tracon-jobs` command line through the cli's `main` (and, where `sys.path`, stdout or
the environment of a process matter, a real `tracon-jobs` process): fresh directories, help
texts, `--version`, `migrate`'s checks, `runs list`, `runs show`, `runs tail`, tiny costs,
`keys list`, `drain --off`, `dev` refusing taken ports before it starts anything, a stdout
closed early, and the `TRACON_*` variables at startup. SQLite only: what is checked here is
the command line, not the stores."""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import MakeRuntime, Script, scripted_agent
from tracon_jobs import __version__
from tracon_jobs.cli import EXIT_BROKEN_PIPE, main
from tracon_jobs.cli.parser import build_parser
from tracon_jobs.numbers import amount_text
from tracon_jobs.runs.store import NewRun
from tracon_jobs.runtime import Runtime

LOOKUP_THEN_ANSWER: Script = [
    {"ToolCalls": [{"Name": "lookup_order", "Arguments": {"order_id": "A-1"}}]},
    {"Text": "Shipped.", "InputTokens": 30, "OutputTokens": 12},
]
FAILING: Script = [{"ErrorStatus": 400}]
TINY: Script = [{"Text": "ok", "InputTokens": 29, "OutputTokens": 12}]
"""29 tokens at 1 and 12 at 2 per million (`scripted_agent`'s prices): 0.000053."""
GROUPS = ["tenants", "keys", "runs", "idempotency", "approvals", "webhooks"]
SCRIPT = Path(sys.executable).with_name("tracon-jobs")
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No `TRACON_*` from the machine, the test's folder as working directory, and
    `sys.path` restored after (`main` puts the working directory first)."""
    for name in list(os.environ):
        if name.upper().startswith("TRACON"):
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    return tmp_path


@pytest.fixture
def runtime(
    clean_env: Path,
    make_runtime: MakeRuntime,
    sqlite_url: str,
    redis_url: str,
    write_config: Callable[..., Path],
    monkeypatch: pytest.MonkeyPatch,
) -> Runtime:
    """The test's runtime (runs execute when the test says) and a `TRACON_CONFIG` for the
    cli on the same database and Redis."""
    config: dict[str, Any] = scripted_agent(LOOKUP_THEN_ANSWER, ["lookup_order"])
    path = write_config(Database={"Url": sqlite_url}, Redis={"Url": redis_url}, **config)
    monkeypatch.setenv("TRACON_CONFIG", str(path))
    return make_runtime(sqlite_url, sender=lambda _run_id: None, **config)


EXPONENT = re.compile(r"[:\[,]\s*-?\d+(\.\d+)?[eE][-+]?\d+")
"""A JSON number in exponent form (`5.3e-05`); not a run id's `...ee-0...`, which is quoted."""


def new_run(runtime: Runtime, tenant: str = "acme") -> str:
    tenant_id = runtime.tenants.ensure_tenant(tenant)
    new = NewRun(tenant_id=tenant_id, agent="demo", input={"message": "A-1"})
    return str(runtime.runs.create(new).id)


# -- a fresh directory ---------------------------------------------------------------------


def test_migrate_in_a_fresh_directory_creates_the_sqlite_folder(
    clean_env: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: `sqlite3.OperationalError: unable to open database file` (no `var/`)."""
    assert not (clean_env / "var").exists()

    assert main(["migrate"]) == 0

    assert (clean_env / "var" / "tracon.db").is_file()
    assert "database migrated: sqlite:///var/tracon.db" in capsys.readouterr().out


def test_a_command_that_opens_the_database_creates_a_nested_sqlite_folder(
    clean_env: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TRACON_DATABASE_URL", "sqlite:///deep/er/t.db")

    assert main(["migrate"]) == 0
    assert main(["tenants", "create", "acme"]) == 0

    assert (clean_env / "deep" / "er" / "t.db").is_file()
    assert "api key (shown once): tjk_" in capsys.readouterr().out


def test_tool_modules_of_the_working_directory_import_from_the_installed_script(
    clean_env: Path, sqlite_url: str, redis_url: str
) -> None:
    """`"ToolModules": ["myapp.tools"]` in the user's own folder, no PYTHONPATH: before,
    `No module named 'myapp'` from the `tracon-jobs` script (`python -m` worked)."""
    (clean_env / "myapp").mkdir()
    (clean_env / "myapp" / "__init__.py").write_text("")
    (clean_env / "myapp" / "tools.py").write_text(
        "from tracon_jobs import tool\n\n\n"
        '@tool(side_effect="read")\n'
        "def my_lookup(key: str) -> str:\n"
        "    return key\n"
    )
    tracon = {"ToolModules": ["myapp.tools"], "Database": {"Url": sqlite_url}}
    tracon["Redis"] = {"Url": redis_url}
    (clean_env / "tracon.json").write_text(json.dumps({"Tracon": tracon}))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}

    done = subprocess.run(
        [str(SCRIPT), "circuits"], cwd=clean_env, env=env, capture_output=True, text=True
    )

    assert done.returncode == 0, done.stderr
    assert "No module named" not in done.stderr
    assert done.stdout.splitlines()[0].split()[:2] == ["provider", "state"]


def test_migrate_refuses_an_agent_naming_an_unknown_tool_as_every_command_does(
    clean_env: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: `database migrated` and exit 0, for a configuration web, worker and every
    operator command refuse."""
    database = clean_env / "var" / "t.db"
    tracon = scripted_agent(TINY, ["no_such_tool"]) | {"Database": {"Url": f"sqlite:///{database}"}}
    (clean_env / "tracon.json").write_text(json.dumps({"Tracon": tracon}))

    for command in (["migrate"], ["workflows", "list"]):
        assert main(command) == 78
        err = capsys.readouterr().err
        assert "Agents.demo.Tools[0]: no tool named 'no_such_tool' is registered" in err

    assert not database.exists()  # refused before the migration


def test_migrate_checks_the_configuration_without_redis(
    clean_env: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A deploy migrates before Redis is up (compose's `migrate` waits for PostgreSQL only)."""
    monkeypatch.setenv("TRACON_REDIS_URL", "redis://127.0.0.1:1/0")  # nothing listens there
    tracon = scripted_agent(TINY, ["lookup_order"])
    (clean_env / "tracon.json").write_text(json.dumps({"Tracon": tracon}))

    assert main(["migrate"]) == 0
    assert "database migrated" in capsys.readouterr().out


# -- help, version, groups -----------------------------------------------------------------


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--version"])

    assert exited.value.code == 0
    assert capsys.readouterr().out.strip() == f"tracon-jobs {__version__}"


def iter_parsers(
    parser: argparse.ArgumentParser, name: str = "tracon-jobs"
) -> list[tuple[str, argparse.ArgumentParser]]:
    """Every parser of the command line with its full command name, the top level first."""
    found = [(name, parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                found += iter_parsers(sub, f"{name} {sub_name}")
    return found


def test_every_command_and_option_has_a_help_text() -> None:
    missing = []
    for name, parser in iter_parsers(build_parser()):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for choice in action._choices_actions:
                    if not choice.help:
                        missing.append(f"{name} {choice.dest}")
            elif not action.help or action.help == argparse.SUPPRESS:
                missing.append(f"{name} {'/'.join(action.option_strings) or action.dest}")

    assert missing == []


@pytest.mark.parametrize(
    ("command", "described"),
    [
        (["dev"], ["--port", "port of the web API", "--flower-port", "port of Flower"]),
        (["runs", "list"], ["--tenant", "tenant name or id", "--status", "any case"]),
        (["runs", "tail"], ["run_id", "the run's id", "--tenant"]),
        (["drain"], ["--off", "end the drain"]),
        (["web"], ["--bind", "HOST:PORT", "--workers", "--threads"]),
    ],
)
def test_command_help_describes_each_option(
    command: list[str], described: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main([*command, "--help"])

    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert all(text in out for text in described), out


@pytest.mark.parametrize("group", GROUPS)
def test_a_group_without_its_action_prints_its_help_and_exits_2(
    group: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: the top-level help (of `sys.argv`, not the group) and exit 0."""
    assert main([group]) == 2

    out = capsys.readouterr().out
    assert out.startswith(f"usage: tracon-jobs {group} ")
    assert "action" in out


# -- runs ----------------------------------------------------------------------------------


def test_runs_list_prints_a_header_then_tokens_and_cost(
    runtime: Runtime, capsys: pytest.CaptureFixture[str]
) -> None:
    run_id = new_run(runtime)
    assert runtime.executor.execute(run_id) == "Completed"

    assert main(["runs", "list", "--tenant", "acme"]) == 0

    header, line = capsys.readouterr().out.splitlines()
    assert header.split() == ["id", "status", "agent", "tokens", "cost", "created", "error"]
    run = runtime.runs.get(run_id)
    assert run is not None
    fields = line.split()
    assert fields[:3] == [run_id, "Completed", "demo"]
    assert int(fields[3]) == run.input_tokens + run.output_tokens > 0
    assert fields[4:6] == [amount_text(run.cost_amount), "USD"]


@pytest.mark.parametrize("written", ["failed", "FAILED", "Failed"])
def test_runs_list_status_is_case_insensitive(
    runtime: Runtime,
    sqlite_url: str,
    make_runtime: MakeRuntime,
    capsys: pytest.CaptureFixture[str],
    written: str,
) -> None:
    ok = new_run(runtime)
    assert runtime.executor.execute(ok) == "Completed"
    failing = make_runtime(sqlite_url, sender=lambda _run_id: None, **scripted_agent(FAILING))
    bad = new_run(failing)
    assert failing.executor.execute(bad) == "Failed"

    assert main(["runs", "list", "--tenant", "acme", "--status", written]) == 0

    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines[1:]] == [bad]


def test_an_unknown_run_status_is_an_error_with_exit_2(
    runtime: Runtime, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: nothing printed, exit 0."""
    with pytest.raises(SystemExit) as exited:
        main(["runs", "list", "--tenant", "acme", "--status", "bogus"])

    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "no run status 'bogus'" in err
    assert "Completed" in err and "Failed" in err


def test_runs_show_prints_the_run_its_events_and_its_tool_calls(
    runtime: Runtime, capsys: pytest.CaptureFixture[str]
) -> None:
    run_id = new_run(runtime)
    assert runtime.executor.execute(run_id) == "Completed"

    assert main(["runs", "show", run_id, "--tenant", "acme"]) == 0

    body = json.loads(capsys.readouterr().out)
    assert body["id"] == run_id and body["status"] == "Completed"
    assert body["events"][-1]["type"] == "RunCompleted"
    [call] = body["toolCalls"]
    assert call["tool"] == "lookup_order"
    assert call["arguments"] == {"order_id": "A-1"}
    assert call["status"] == "succeeded"
    assert list(body)[-2:] == ["events", "toolCalls"]


def test_runs_show_of_another_tenant_is_no_run(
    runtime: Runtime, capsys: pytest.CaptureFixture[str]
) -> None:
    run_id = new_run(runtime)
    runtime.tenants.ensure_tenant("globex")

    assert main(["runs", "show", run_id, "--tenant", "globex"]) == 1
    assert f"no run '{run_id}' of tenant 'globex'" in capsys.readouterr().err


def test_runs_tail_follows_a_run_live_until_its_terminal_event(
    runtime: Runtime, capsys: pytest.CaptureFixture[str]
) -> None:
    run_id = new_run(runtime)
    started = threading.Event()

    def execute_later() -> None:
        started.wait(10)
        time.sleep(0.5)  # the tail is waiting on the feed by now
        runtime.executor.execute(run_id)

    thread = threading.Thread(target=execute_later)
    thread.start()
    try:
        started.set()
        began = time.monotonic()
        assert main(["runs", "tail", run_id, "--tenant", "acme"]) == 0
        waited = time.monotonic() - began
    finally:
        thread.join(30)

    lines = capsys.readouterr().out.splitlines()
    types = [line.split()[2] for line in lines]
    assert types[0] == "RunQueued"
    assert "RunStarted" in types and "ToolCallCompleted" in types
    assert types[-1] == "RunCompleted"
    assert [int(line.split()[0]) for line in lines] == list(range(1, len(lines) + 1))
    assert waited >= 0.4  # it followed the run rather than printing what was there
    assert '"tool":"lookup_order"' in next(line for line in lines if "ToolCallStarted" in line)


def test_runs_tail_of_an_ended_run_prints_its_events_and_returns(
    runtime: Runtime, capsys: pytest.CaptureFixture[str]
) -> None:
    run_id = new_run(runtime)
    assert runtime.executor.execute(run_id) == "Completed"

    assert main(["runs", "tail", run_id]) == 0

    assert capsys.readouterr().out.splitlines()[-1].split()[2] == "RunCompleted"
    assert main(["runs", "tail", "no-such-run"]) == 1


def test_a_tiny_cost_keeps_its_digits_in_every_command(
    clean_env: Path,
    make_runtime: MakeRuntime,
    sqlite_url: str,
    redis_url: str,
    write_config: Callable[..., Path],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Before: `0.0000 USD` in `runs list`, `5.3e-05` in `runs show` and `runs tail`, and a
    `--cost-limit 1e2` shown as `1E+2 USD`."""
    config: dict[str, Any] = scripted_agent(TINY)
    path = write_config(Database={"Url": sqlite_url}, Redis={"Url": redis_url}, **config)
    monkeypatch.setenv("TRACON_CONFIG", str(path))
    runtime = make_runtime(sqlite_url, sender=lambda _run_id: None, **config)
    run_id = new_run(runtime)
    assert runtime.executor.execute(run_id) == "Completed"
    run = runtime.runs.get(run_id)
    assert run is not None and run.cost_amount == Decimal("0.000053")

    assert main(["runs", "list", "--tenant", "acme"]) == 0
    assert capsys.readouterr().out.splitlines()[1].split()[4:6] == ["0.000053", "USD"]

    assert main(["runs", "show", run_id]) == 0
    shown = capsys.readouterr().out
    assert '"amount": 0.000053,' in shown and not EXPONENT.search(shown)
    assert json.loads(shown)["cost"]["amount"] == 0.000053

    assert main(["runs", "tail", run_id]) == 0
    tailed = capsys.readouterr().out
    assert '"amount":0.000053' in tailed and not EXPONENT.search(tailed)  # the call's cost

    assert main(["tenants", "quota", "acme", "--cost-limit", "1e2"]) == 0
    quota = capsys.readouterr().out
    assert "100.00 USD per day; used 0.000053 USD, left 99.999947 USD" in quota


def test_keys_list_names_each_keys_tenant_and_keeps_its_id(
    runtime: Runtime, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: the first 20 characters of the tenant's id under TENANT."""
    acme, globex = runtime.tenants.ensure_tenant("acme"), runtime.tenants.ensure_tenant("globex")
    acme_key, globex_key = runtime.tenants.issue_key(acme), runtime.tenants.issue_key(globex)
    assert runtime.tenants.revoke(globex_key.key_id)

    assert main(["keys", "list"]) == 0

    header, *lines = capsys.readouterr().out.splitlines()
    assert header.split() == ["KEY", "TENANT", "CREATED", "LAST", "USED", "REVOKED", "TENANT", "ID"]
    rows = {line.split()[0]: line.split() for line in lines}
    assert rows[acme_key.key_id][1] == "acme" and rows[acme_key.key_id][-1] == acme
    assert rows[globex_key.key_id][1] == "globex" and rows[globex_key.key_id][-1] == globex
    assert rows[acme_key.key_id][4:6] == ["-", "-"]  # never used, not revoked
    assert len(rows[globex_key.key_id]) == 8  # revoked: its date and time, not `-`
    assert main(["keys", "list", "--tenant", "globex"]) == 0
    assert [line.split()[0] for line in capsys.readouterr().out.splitlines()[1:]] == [
        globex_key.key_id
    ]


# -- drain ---------------------------------------------------------------------------------


def test_drain_off_ends_a_drain(
    clean_env: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    flag = clean_env / "flags" / "drain"
    monkeypatch.setenv("TRACON_DRAIN_FILE", str(flag))

    assert main(["drain"]) == 0
    assert flag.exists()
    assert main(["drain", "--off"]) == 0
    assert not flag.exists()
    out = capsys.readouterr().out
    assert "drain ended" in out
    assert main(["drain", "--off"]) == 0  # ending no drain is fine, and says so
    assert "not draining" in capsys.readouterr().out


# -- dev: ports ----------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@pytest.fixture
def held_port() -> Iterator[int]:
    """A port something listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


@pytest.mark.parametrize(("taken", "option"), [("web", "--port"), ("flower", "--flower-port")])
def test_dev_refuses_a_taken_port_before_starting_anything(
    clean_env: Path,
    held_port: int,
    taken: str,
    option: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Before: the whole banner with a new API key, then everything stopped and exit 0."""
    from tracon_jobs.cli import supervisor

    def no_start(*_: Any, **__: Any) -> None:
        raise AssertionError("dev started a process although a port is taken")

    monkeypatch.setattr(supervisor.Supervisor, "start", no_start)
    ports = {"web": free_port(), "flower": free_port(), taken: held_port}

    code = main(["dev", "--port", str(ports["web"]), "--flower-port", str(ports["flower"])])

    assert code == 1
    captured = capsys.readouterr()
    assert f"port {held_port}" in captured.err and option in captured.err
    assert "API key" not in captured.out + captured.err
    assert not (clean_env / "var").exists()  # no database, no embedded Redis either


def test_dev_refuses_one_port_for_both(clean_env: Path, capsys: pytest.CaptureFixture[str]) -> None:
    port = str(free_port())

    assert main(["dev", "--port", port, "--flower-port", port]) == 1
    assert "cannot share port" in capsys.readouterr().err


def test_dev_ports_must_be_ports(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["dev", "--port", "70000"])

    assert exited.value.code == 2
    assert "1 to 65535" in capsys.readouterr().err


# -- a real process: stdout closed early, the environment at startup ----------------------


def cli(arguments: list[str], cwd: Path, stderr: Any, **env: str) -> subprocess.Popen[bytes]:
    """`python -m tracon_jobs.cli ARGUMENTS`, its stdout a pipe this test reads; stdout
    block-buffered, as a user's shell starts it, unless `env` says PYTHONUNBUFFERED."""
    inherited = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    return subprocess.Popen(
        [sys.executable, "-m", "tracon_jobs.cli", *arguments],
        cwd=cwd,
        env={**inherited, "PYTHONPATH": str(ROOT), **env},
        stdout=subprocess.PIPE,
        stderr=stderr,
    )


def assert_quiet(stderr: str) -> None:
    for noise in ("Traceback", "BrokenPipeError", "Exception ignored"):
        assert noise not in stderr, stderr


@pytest.mark.parametrize("unbuffered", [{}, {"PYTHONUNBUFFERED": "1"}])
def test_a_reader_that_closes_after_one_line_ends_runs_show_quietly(
    runtime: Runtime, tmp_path: Path, unbuffered: dict[str, str]
) -> None:
    """`runs show ID | head -1`: before, a BrokenPipeError traceback and exit 1. Unbuffered
    (as `dev` starts its children), the `print` itself meets the closed pipe."""
    tenant = runtime.tenants.ensure_tenant("acme")
    lines = [f"line {n:05d} " + "x" * 90 for n in range(3000)]  # 300 KB: more than a pipe holds
    run = runtime.runs.create(NewRun(tenant_id=tenant, agent="demo", input={"lines": lines}))

    with (tmp_path / "stderr").open("w+") as err:
        process = cli(["runs", "show", run.id], tmp_path, err, **unbuffered)
        assert process.stdout is not None
        first = process.stdout.readline()
        process.stdout.close()  # what `head -1` does once it has its line
        code = process.wait(timeout=60)
        err.seek(0)
        stderr = err.read()

    assert first == b"{\n"
    assert code == EXIT_BROKEN_PIPE, stderr
    assert_quiet(stderr)


@pytest.mark.parametrize("command", [["--help"], ["keys", "list"], ["runs", "tail", "RUN"]])
def test_every_command_ends_quietly_when_its_reader_is_gone_before_it_writes(
    runtime: Runtime, tmp_path: Path, command: list[str]
) -> None:
    """`tracon-jobs ... | true`: the short output is written at the end, into a closed pipe
    (before: `Exception ignored ... BrokenPipeError`, or a traceback)."""
    run_id = new_run(runtime)
    assert runtime.executor.execute(run_id) == "Completed"
    command = [run_id if part == "RUN" else part for part in command]

    with (tmp_path / "stderr").open("w+") as err:
        process = cli(command, tmp_path, err)
        assert process.stdout is not None
        process.stdout.close()  # the reader is gone before the first write
        code = process.wait(timeout=60)
        err.seek(0)
        stderr = err.read()

    assert code == EXIT_BROKEN_PIPE, stderr
    assert_quiet(stderr)


def test_a_variable_that_configures_nothing_is_warned_of_at_startup(
    runtime: Runtime, tmp_path: Path
) -> None:
    """`TRACON_CIRCUITBREAKER__FAILURETHRESHOLD=0` (one underscore after the prefix) overrides
    nothing: before, the command ran without a word about it."""
    with (tmp_path / "stderr").open("w+") as err:
        process = cli(
            ["workflows", "list"], tmp_path, err, TRACON_CIRCUITBREAKER__FAILURETHRESHOLD="0"
        )
        out, _ = process.communicate(timeout=60)
        err.seek(0)
        stderr = err.read()

    assert process.returncode == 0, stderr
    assert out.decode().split() == ["WORKFLOW", "DESCRIPTION"]
    [warning] = [line for line in stderr.splitlines() if "configures nothing" in line]
    assert " WARNING tracon_jobs.settings environment variable " in warning
    assert warning.endswith(
        "TRACON_CIRCUITBREAKER__FAILURETHRESHOLD configures nothing; "
        "did you mean TRACON__CIRCUITBREAKER__FAILURETHRESHOLD?"
    )


def test_the_setting_spelled_right_with_a_value_breaking_its_rule_fails_naming_it(
    runtime: Runtime, tmp_path: Path
) -> None:
    with (tmp_path / "stderr").open("w+") as err:
        process = cli(["migrate"], tmp_path, err, TRACON__CIRCUITBREAKER__FAILURETHRESHOLD="0")
        process.communicate(timeout=60)
        err.seek(0)
        stderr = err.read()

    assert process.returncode == 78, stderr
    assert (
        "tracon-jobs: Invalid configuration: CircuitBreaker.FailureThreshold: must be at least 1 "
        "(got 0) (from environment variable TRACON__CIRCUITBREAKER__FAILURETHRESHOLD)"
    ) in stderr
    assert "configures nothing" not in stderr and "database migrated" not in stderr
