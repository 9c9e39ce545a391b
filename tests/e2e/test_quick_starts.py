"""The two quick starts as a newcomer types them, from a fresh clone, with nothing reused: the
README's (`make run`, which makes `.venv` and installs the project into it) and the one for an
agent of one's own (docs/own-agent.md: a venv of one's own, `pip install` of the clone, a
`tracon.json` and a tools module in an empty folder outside the clone, `tracon-jobs dev`).

The commands and files are read from the documents themselves, so a page that drifts from what
works fails here. What a test adds to them: the ports (`make run PORT=… FLOWER_PORT=…` and
`dev --port … --flower-port …`, both documented, since 8000 may be taken on the machine), and
the Redis (`TRACON_REDIS_URL`, documented, a database of this test process's own server: a
test never touches the machine's Redis). Each run is followed to its end, the banner's second
command is typed as printed, and Ctrl-C (SIGINT to the foreground process group, as a terminal
sends it) must leave no process behind.

Installing takes a minute or two (pip's cache serves the dependencies); both tests are `long`
so they start first and overlap the rest of the suite.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from tests.conftest import redis_db
from tests.e2e.test_dev_processes import (
    descendants,
    free_port,
    make_clone,
    survivors,
)
from tests.helpers import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.long, pytest.mark.timeout(1200)]

SOURCE = Path(__file__).resolve().parents[2]
INSTALL_SECONDS = 900.0
RUN_SECONDS = 90.0
STOP_SECONDS = 60.0


def blocks(document: Path, section: str) -> list[tuple[str, str]]:
    """(info string, text) of each fenced block of `document`'s `section` (a heading's text),
    in order."""
    text = document.read_text(encoding="utf-8")
    if section:
        start = text.index(section)
        following = re.search(r"^## ", text[start + len(section) :], re.MULTILINE)
        text = text[start : start + len(section) + (following.start() if following else len(text))]
    return [
        (m.group(1), m.group(2)) for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.M | re.S)
    ]


def environment(redis_url: str) -> dict[str, str]:
    """The machine's environment as a newcomer's shell has it: no `TRACON*`, no `PYTHONPATH`,
    no venv on `PATH`; the test process's own Redis."""
    env = {
        name: value
        for name, value in os.environ.items()
        if not name.upper().startswith(("TRACON", "PYTEST", "FLOWER", "VIRTUAL_ENV"))
        and name != "PYTHONPATH"
    }
    env["PATH"] = os.pathsep.join(
        part for part in env.get("PATH", "").split(os.pathsep) if "venv" not in part
    )
    env.update(TRACON_REDIS_URL=redis_url, PYTHONUNBUFFERED="1")
    return env


@pytest.fixture
def own_redis(redis_url: str) -> Iterator[str]:
    url = redis_db(redis_url, 1)
    client = redis.Redis.from_url(url)
    client.flushdb()
    yield url
    client.flushdb()
    client.close()


class Foreground:
    """A command started as a terminal's foreground job: its own process group, its output in
    a file; stopped with SIGINT to the group (Ctrl-C)."""

    def __init__(self, argv: list[str] | str, cwd: Path, env: dict[str, str], log: Path) -> None:
        self.log = log
        with log.open("wb") as out:
            self.popen = subprocess.Popen(
                argv,
                cwd=cwd,
                env=env,
                shell=isinstance(argv, str),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        self.seen: dict[int, tuple[int, str]] = {}

    @property
    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def ready(self, port: int) -> bool:
        assert self.popen.poll() is None, f"exited early:\n{self.output[-4000:]}"
        self.seen.update(descendants(self.popen.pid))
        try:
            answer = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2)
        except httpx.HTTPError:
            return False
        return answer.status_code == 200 and "API key:" in self.output

    def wait_ready(self, port: int, timeout: float) -> None:
        try:
            wait_until(lambda: self.ready(port), what="the banner", timeout=timeout, interval=0.5)
        except TimeoutError as exc:
            raise TimeoutError(f"{exc}:\n{self.output[-4000:]}") from None
        self.seen.update(descendants(self.popen.pid))

    def key(self) -> str:
        match = re.search(r"API key: (tjk_\S+)", self.output)
        assert match, self.output[-3000:]
        return match.group(1)

    def interrupt(self) -> None:
        self.seen.update(descendants(self.popen.pid))
        os.killpg(self.popen.pid, signal.SIGINT)
        self.popen.wait(timeout=STOP_SECONDS)
        with contextlib.suppress(TimeoutError):
            wait_until(lambda: not survivors(self.seen), what="no survivor", timeout=10)
        assert survivors(self.seen) == [], self.output[-3000:]

    def kill(self) -> None:
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(10)
        for pid in self.seen:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture
def foreground() -> Iterator[list[Foreground]]:
    started: list[Foreground] = []
    yield started
    for job in started:
        job.kill()


def banner_command(output: str, ending: str) -> str:
    lines = [line.strip() for line in output.splitlines()]
    return next(line for line in lines if line.endswith(ending))


def test_the_readme_quick_start_from_a_fresh_clone(
    tmp_path: Path, own_redis: str, foreground: list[Foreground]
) -> None:
    clone = make_clone(tmp_path / "tracon-jobs")
    assert not (clone / ".venv").exists()
    [(_, commands), *_] = blocks(SOURCE / "README.md", "## Quick start")
    run_line = next(line for line in commands.splitlines() if line.startswith("make run"))
    assert run_line.split("#")[0].split() == ["make", "run"]
    port, flower = free_port(), free_port()
    env = environment(own_redis)

    # When the newcomer types `make run` (on ports of the test's choosing)
    job = Foreground(
        ["make", "run", f"PORT={port}", f"FLOWER_PORT={flower}"],
        clone,
        env,
        tmp_path / "make-run.log",
    )
    foreground.append(job)
    job.wait_ready(port, INSTALL_SECONDS)

    # Then the banner's curl runs the demo agent to its end
    curl = re.search(r"curl -N -X POST http://127\.0\.0\.1:\d+(/api/agents/\S+/run)", job.output)
    assert curl, job.output[-3000:]
    headers = {"Authorization": f"Bearer {job.key()}"}
    with httpx.stream(
        "POST",
        f"http://127.0.0.1:{port}{curl.group(1)}",
        json={"message": "Where is order A-1001?"},
        headers=headers,
        timeout=RUN_SECONDS,
    ) as answer:
        events = "".join(answer.iter_text())
    assert "event: RunCompleted" in events and "A-1001" in events, events[-2000:]
    # And the banner's second command works as printed, from the clone
    command = banner_command(job.output, "runs list --tenant dev")
    listed = subprocess.run(
        command, shell=True, cwd=clone, env=env, capture_output=True, text=True, timeout=60
    )
    assert listed.returncode == 0, listed.stderr
    assert "Completed" in listed.stdout and "demo" in listed.stdout
    # And Ctrl-C stops every process it started
    job.interrupt()


def test_the_own_agent_quick_start_from_a_folder_outside_the_clone(
    tmp_path: Path, own_redis: str, foreground: list[Foreground]
) -> None:
    clone = make_clone(tmp_path / "tracon-jobs")
    steps = blocks(SOURCE / "docs" / "own-agent.md", "")
    shell = [text for info, text in steps if info == "bash"]
    [tools] = [text for info, text in steps if info == "python"]
    [config] = [text for info, text in steps if info == "json"]
    install, start, ask = shell
    env = environment(own_redis)

    # When the newcomer installs the clone into a venv of their own folder, as written
    done = subprocess.run(
        ["bash", "-e", "-c", install],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=INSTALL_SECONDS,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    folder = tmp_path / "my-agent"
    assert "would be ignored" not in done.stdout + done.stderr  # the package builds cleanly
    # And writes the two files, and starts dev there (on ports of the test's choosing)
    (folder / "tools.py").write_text(tools)
    (folder / "tracon.json").write_text(config)
    port, flower = free_port(), free_port()
    job = Foreground(
        f"{start.strip()} --port {port} --flower-port {flower}", folder, env, tmp_path / "dev.log"
    )
    foreground.append(job)
    job.wait_ready(port, RUN_SECONDS * 2)
    assert str(clone) not in job.output  # nothing of the clone runs: the installed package does

    # Then the page's curl asks the agent, which calls the newcomer's own tool
    asked = subprocess.run(
        ["bash", "-e", "-c", ask.replace("127.0.0.1:8000", f"127.0.0.1:{port}")],
        cwd=folder,
        env=dict(env, KEY=job.key()),
        capture_output=True,
        text=True,
        timeout=RUN_SECONDS,
    )
    assert asked.returncode == 0, asked.stderr
    events = asked.stdout
    assert "event: ToolCallCompleted" in events and '"tool":"stock_level"' in events, events
    assert "event: RunCompleted" in events and "We are out of oat milk." in events, events
    # And the banner's second command works as printed, from that folder
    command = banner_command(job.output, "runs list --tenant dev")
    listed = subprocess.run(
        command, shell=True, cwd=folder, env=env, capture_output=True, text=True, timeout=60
    )
    assert listed.returncode == 0, listed.stderr
    assert "Completed" in listed.stdout and "barista" in listed.stdout
    # And the tool's answer in the run's ledger is the one of the newcomer's module
    run_id = listed.stdout.splitlines()[1].split()[0]
    shown = subprocess.run(
        f"{command.split(' runs ')[0]} runs show {run_id}",
        shell=True,
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert shown.returncode == 0, shown.stderr
    [call] = json.loads(shown.stdout)["toolCalls"]
    assert call["tool"] == "stock_level", call
    assert '"on_shelf": 0' in json.dumps(call), call
    assert (folder / "var").is_dir()  # its database is in the newcomer's folder
    job.interrupt()
