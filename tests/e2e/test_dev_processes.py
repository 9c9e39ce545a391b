"""`tracon-jobs dev` for real, from a fresh clone: no `var/`, no `tracon.json`, nothing but the
tracked files. It must start on the ports it is given, with the local Redis or, when the
configured one does not answer, an embedded one (and say so), answer /healthz, run an agent
submitted over HTTP with the key it printed, and leave no child behind on SIGINT or SIGTERM.

The clone: `git clone` of /work/main into a temporary folder, with the working tree's
uncommitted changes copied over it (so the code under test runs, not the last commit); set
`TRACON_TEST_DEV_REVISION` (e.g. `7c848b6`) to run a plain checkout of that revision instead.
Its commands run with the venv of /work/main (`<venv>/bin/python -m tracon_jobs.cli dev`, cwd
the clone, `PYTHONPATH` the clone), so the test does not reinstall the project; what it does
not cover of `make run` is creating `.venv` and `pip install`.

Children are found in /proc (the process tree under `dev`, recorded while it runs) and each
one must be gone, or a zombie, once `dev` has exited.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis

from tests.conftest import redis_db
from tests.helpers import ENDED, wait_until

pytestmark = pytest.mark.e2e

SOURCE = Path(__file__).resolve().parents[2]
PYTHON = sys.executable
"""The venv of the project under test, reused by the clone's commands."""
START_SECONDS = 90.0
RUN_SECONDS = 90.0
"""Longer than `Runs.RequeueAfter` (60 s), which re-sends a run whose message was lost."""
STOP_SECONDS = 60.0


# -- the clone -----------------------------------------------------------------------------


def _git(*args: str, cwd: Path = SOURCE) -> str:
    return subprocess.run(
        ["git", *args], cwd=cwd, check=True, capture_output=True, text=True
    ).stdout


@pytest.fixture(scope="module")
def clone(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_clone(tmp_path_factory.mktemp("fresh") / "tracon-jobs")


def make_clone(target: Path) -> Path:
    """A fresh clone at `target`: the tracked files with the working tree's changes over them
    (see the module's docstring)."""
    subprocess.run(
        ["git", "clone", "--quiet", str(SOURCE), str(target)], check=True, capture_output=True
    )
    revision = os.environ.get("TRACON_TEST_DEV_REVISION")
    if revision:
        _git("checkout", "--quiet", revision, cwd=target)
        return target
    listed = _git("ls-files", "-z", "--cached", "--others", "--exclude-standard")
    for name in filter(None, listed.split("\0")):
        source = SOURCE / name
        if source.is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name)
        elif not source.exists():
            (target / name).unlink(missing_ok=True)  # deleted in the working tree
    assert not (target / "var").exists() and not (target / "tracon.json").exists()
    return target


@pytest.fixture
def fresh(clone: Path) -> Iterator[Path]:
    """The clone as a fresh one: whatever an earlier dev wrote under `var/` is gone."""
    shutil.rmtree(clone / "var", ignore_errors=True)
    yield clone
    shutil.rmtree(clone / "var", ignore_errors=True)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@pytest.fixture
def own_redis_url(redis_url: str) -> Iterator[str]:
    """The test process's Redis, on a database of its own beside the session's (which every
    test flushes), so no other worker consumes dev's runs; flushed before and after."""
    url = redis_db(redis_url, 1)
    client = redis.Redis.from_url(url)
    client.flushdb()
    yield url
    client.flushdb()
    client.close()


def dead_redis_url() -> str:
    """A Redis URL nothing answers on (a port just freed)."""
    return f"redis://127.0.0.1:{free_port()}/0"


def clone_env(clone: Path, redis_url: str) -> dict[str, str]:
    """The machine's environment without any `TRACON*` or `PYTHONPATH` of its own."""
    env = {
        name: value
        for name, value in os.environ.items()
        if not name.upper().startswith(("TRACON", "PYTEST", "FLOWER")) and name != "PYTHONPATH"
    }
    env.update(PYTHONPATH=str(clone), TRACON_REDIS_URL=redis_url, PYTHONUNBUFFERED="1")
    return env


# -- processes from /proc ------------------------------------------------------------------


def _stat(pid: int) -> tuple[int, str, int] | None:
    """(parent pid, state, start time) of a process, or None once it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = text[text.rindex(")") + 2 :].split()
    return int(fields[1]), fields[0], int(fields[19])


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return ""


def descendants(root: int) -> dict[int, tuple[int, str]]:
    """Every process under `root`: pid -> (start time, command line)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            stat = _stat(int(entry.name))
            if stat is not None:
                parents.setdefault(stat[0], []).append(int(entry.name))
    found: dict[int, tuple[int, str]] = {}
    todo = list(parents.get(root, []))
    while todo:
        pid = todo.pop()
        stat = _stat(pid)
        if stat is not None:
            found[pid] = (stat[2], _cmdline(pid))
            todo += parents.get(pid, [])
    return found


def survivors(seen: dict[int, tuple[int, str]]) -> list[str]:
    """The recorded processes still alive (the same process: same start time, not a zombie)."""
    alive = []
    for pid, (started, command) in seen.items():
        stat = _stat(pid)
        if stat is not None and stat[2] == started and stat[1] != "Z":
            alive.append(f"{pid} {command}")
    return alive


# -- dev -----------------------------------------------------------------------------------


@dataclass
class Dev:
    """One `tracon-jobs dev` in the clone, its output in a file."""

    clone: Path
    env: dict[str, str]
    port: int
    flower_port: int
    log: Path
    popen: subprocess.Popen[bytes] | None = None
    seen: dict[int, tuple[int, str]] = field(default_factory=dict)

    def start(self) -> None:
        argv = [PYTHON, "-m", "tracon_jobs.cli", "dev", "--port", str(self.port)]
        argv += ["--flower-port", str(self.flower_port)]
        with self.log.open("wb") as out:
            self.popen = subprocess.Popen(
                argv,
                cwd=self.clone,
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

    @property
    def output(self) -> str:
        return self.log.read_text(errors="replace")

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def healthy(self) -> bool:
        """Its /healthz answers and it printed the key; fails at once when it exited."""
        assert self.alive(), f"dev exited early:\n{self.output[-4000:]}"
        self.record_children()
        try:
            with urllib.request.urlopen(self.url("/healthz"), timeout=2) as response:
                return response.status == 200 and "API key:" in self.output
        except (urllib.error.URLError, OSError):
            return False

    def wait_until_healthy(self) -> None:
        try:
            wait_until(self.healthy, what="dev", timeout=START_SECONDS, interval=0.25)
        except TimeoutError as exc:
            raise TimeoutError(f"{exc}:\n{self.output[-4000:]}") from None
        self.record_children()

    def record_children(self) -> None:
        self.seen.update(descendants(self.pid))

    def key(self) -> str:
        match = re.search(r"API key: (tjk_\S+)", self.output)
        assert match, self.output[-3000:]
        return match.group(1)

    def request(self, method: str, path: str, body: Any = None, **headers: str) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.url(path),
            data=data,
            method=method,
            headers={
                "Authorization": f"Bearer {self.key()}",
                "Content-Type": "application/json",
                **headers,
            },
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read() or b"null")

    def stop(self, signum: signal.Signals) -> int:
        """Send `signum` to dev alone (as a terminal's Ctrl-C reaches the foreground process),
        wait for it to exit; its exit code."""
        assert self.popen is not None
        self.record_children()
        self.popen.send_signal(signum)
        return self.popen.wait(timeout=STOP_SECONDS)

    def kill_everything(self) -> None:
        """Teardown after a failure: no process of the test outlives it."""
        if self.popen is not None and self.alive():
            self.record_children()
            self.popen.kill()
            self.popen.wait(10)
        for pid, (started, _) in self.seen.items():
            stat = _stat(pid)
            if stat is not None and stat[2] == started:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


@pytest.fixture
def make_dev(fresh: Path, tmp_path: Path) -> Iterator[Any]:
    started: list[Dev] = []

    def make(redis_url: str) -> Dev:
        dev = Dev(
            fresh, clone_env(fresh, redis_url), free_port(), free_port(), tmp_path / "dev.log"
        )
        while dev.flower_port == dev.port:
            dev.flower_port = free_port()
        started.append(dev)
        dev.start()
        return dev

    yield make
    for dev in started:
        dev.kill_everything()


def submit_and_complete(dev: Dev) -> str:
    """A run sent over HTTP with the printed key: its id once it has completed."""
    agent = re.search(r"curl -N -X POST http://127\.0\.0\.1:\d+(/api/agents/\S+/run)", dev.output)
    assert agent, dev.output[-3000:]
    status, body = dev.request(
        "POST", agent.group(1), {"message": "Where is order A-1001?"}, Prefer="respond-async"
    )
    assert status == 202, body
    run_id: str = body["runId"]
    run: dict[str, Any] = {}

    def ended() -> bool:
        run.update(dev.request("GET", f"/api/runs/{run_id}")[1])
        return run["status"] in ENDED

    try:
        wait_until(ended, what=f"run {run_id}", timeout=RUN_SECONDS, interval=0.25)
    except TimeoutError as exc:
        raise TimeoutError(f"{exc}:\n{dev.output[-3000:]}") from None
    assert run["status"] == "Completed", run
    assert run["output"]["text"]
    return run_id


def assert_all_gone(dev: Dev) -> None:
    names = " ".join(command for _, command in dev.seen.values())
    for child in ("web", "worker", "beat", "flower"):
        assert f"tracon_jobs.cli {child}" in names, (child, names)
    # a reparented zombie is reaped by init in its own time; the assertion names the survivors
    with contextlib.suppress(TimeoutError):
        wait_until(lambda: not survivors(dev.seen), what="no survivor", timeout=5, interval=0.1)
    assert survivors(dev.seen) == []
    for port in (dev.port, dev.flower_port):
        with socket.socket() as sock:
            assert sock.connect_ex(("127.0.0.1", port)) != 0, f"port {port} still answers"
    # and quietly: no process printed a traceback on its way out (Flower's SIGTERM handler
    # used to, when the supervisor's SIGTERM found it already leaving)
    assert "Traceback" not in dev.output and "Exception ignored" not in dev.output, dev.output


def runs_list(dev: Dev) -> str:
    """The banner's `runs list --tenant dev` line, typed in the clone as a user would, by a
    shell whose `PATH` has no venv on it."""
    lines = [line.strip() for line in dev.output.splitlines()]
    command = next(line for line in lines if line.endswith("runs list --tenant dev"))
    path = os.pathsep.join(
        part for part in os.environ.get("PATH", "").split(os.pathsep) if "venv" not in part
    )
    done = subprocess.run(
        command,
        shell=True,
        cwd=dev.clone,
        env=dict(
            dev.env,
            PATH=path,
            TRACON_CONFIG=str(dev.clone / "tracon_jobs" / "demo" / "config.json"),
        ),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


# -- the tests -----------------------------------------------------------------------------


def test_dev_from_a_fresh_clone_with_the_local_redis_runs_an_agent_and_stops_on_sigint(
    make_dev: Any, own_redis_url: str
) -> None:
    """Before (7c848b6): `sqlite3.OperationalError: unable to open database file` at once, the
    ports fixed at 8000 and 5555."""
    dev: Dev = make_dev(own_redis_url)
    dev.wait_until_healthy()

    out = dev.output
    assert f"web http://127.0.0.1:{dev.port}" in out
    assert f"Flower http://127.0.0.1:{dev.flower_port}" in out
    assert f"redis: {own_redis_url}" in out and "embedded" not in out
    assert "development tenant: dev" in out
    run_id = submit_and_complete(dev)
    assert run_id in runs_list(dev)

    assert dev.stop(signal.SIGINT) == 0
    assert_all_gone(dev)


def test_dev_with_a_dead_redis_says_so_uses_an_embedded_one_and_stops_on_sigint(
    make_dev: Any,
) -> None:
    """Before: the embedded Redis was used without a word about the configured one."""
    dead = dead_redis_url()
    dev: Dev = make_dev(dead)
    dev.wait_until_healthy()

    out = dev.output
    assert f"redis: {dead} (from TRACON_REDIS_URL) did not answer" in out
    assert "using an embedded redis instead: redis://127.0.0.1:" in out
    assert any("redis-server" in command for _, command in dev.seen.values())
    submit_and_complete(dev)

    assert dev.stop(signal.SIGINT) == 0
    assert_all_gone(dev)  # the embedded redis-server included


def test_dev_names_the_configuration_file_when_the_redis_it_names_is_dead(
    fresh: Path, tmp_path: Path
) -> None:
    """Before: "(from TRACON_REDIS_URL)" whatever named it: `dev` sets that variable for its
    children before it wrote the line."""
    dead = dead_redis_url()
    config = json.loads((fresh / "tracon_jobs" / "demo" / "config.json").read_text())
    config["Tracon"]["Redis"] = {"Url": dead}
    path = tmp_path / "tracon-dead-redis.json"
    path.write_text(json.dumps(config))
    env = clone_env(fresh, dead)
    del env["TRACON_REDIS_URL"]
    env["TRACON_CONFIG"] = str(path)
    dev = Dev(fresh, env, free_port(), free_port(), tmp_path / "dev.log")
    try:
        dev.start()
        dev.wait_until_healthy()
        out = dev.output
        assert f"redis: {dead} (from the configuration file) did not answer" in out, out
        assert dev.stop(signal.SIGINT) == 0
        assert_all_gone(dev)
    finally:
        dev.kill_everything()


def test_dev_stops_every_child_on_sigterm(make_dev: Any, own_redis_url: str) -> None:
    dev: Dev = make_dev(own_redis_url)
    dev.wait_until_healthy()

    dev.stop(signal.SIGTERM)
    assert_all_gone(dev)


def test_dev_with_its_web_port_taken_says_which_and_starts_nothing(
    fresh: Path, tmp_path: Path, redis_url: str
) -> None:
    """Before: the whole banner with a new API key, everything stopped, exit 0, no reason."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        dev = Dev(fresh, clone_env(fresh, redis_url), port, free_port(), tmp_path / "dev.log")
        dev.start()
        assert dev.popen is not None
        code = dev.popen.wait(timeout=60)

    assert code != 0
    assert f"port {port} on 127.0.0.1, wanted for the web API, is already in use" in dev.output
    assert "--port N" in dev.output
    assert "API key" not in dev.output
    assert not (fresh / "var").exists()
