""".ci/services, the part of .ci/run that makes PostgreSQL, chromium and pgbouncer be there: on
this machine as it is, and on machines without them, where `PATH` holds only the shell's own
tools and stand-ins for the system's commands (apt-get, pg_isready, pg_lsclusters,
pg_ctlcluster, pg_createcluster, pg_dropcluster, chromium, pgbouncer, id), each logging its
call."""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.e2e.cluster import REPO

pytestmark = pytest.mark.timeout(60)

SCRIPT = REPO / ".ci" / "services"
TOOLS = [
    "bash",
    "env",
    "ls",
    "sort",
    "tail",
    "head",
    "sleep",
    "cat",
    "touch",
    "cp",
    "rm",
    "timeout",
]
"""The real commands the script's sandbox keeps (what it and the stand-ins call)."""
CLUSTER = "15  main    5432 down   postgres /var/lib/postgresql/15/main /var/log/x.log\n"

STANDINS = {
    # answers once a cluster was started (the `up` file), as a real server would
    "pg_isready": '[ -e "$SANDBOX/up" ]',
    "pg_lsclusters": 'cat "$SANDBOX/clusters" 2>/dev/null || true',
    "pg_ctlcluster": 'echo "pg_ctlcluster $*" >>"$SANDBOX/calls"; touch "$SANDBOX/up"',
    "pg_createcluster": 'echo "pg_createcluster $*" >>"$SANDBOX/calls"',
    "pg_dropcluster": 'echo "pg_dropcluster $*" >>"$SANDBOX/calls"; rm -f "$SANDBOX/up"',
    "id": 'cat "$SANDBOX/uid"',
}
APT_GET = """
echo "apt-get $*" >>"$SANDBOX/calls"
[ -e "$SANDBOX/apt-works" ] || exit 100
case "$*" in
  *"install -y postgresql"*)
    # Debian's package: the client, the cluster tools, and a running cluster `main`
    for tool in pg_isready pg_lsclusters pg_ctlcluster pg_createcluster pg_dropcluster; do
      cp "$SANDBOX/available/$tool" "$SANDBOX/bin/"
    done
    echo "15 main 5432 online postgres /x /y" >"$SANDBOX/clusters"; touch "$SANDBOX/up" ;;
  *"install -y chromium"*) cp "$SANDBOX/available/chromium" "$SANDBOX/bin/" ;;
  *"install -y pgbouncer"*) cp "$SANDBOX/available/pgbouncer" "$SANDBOX/bin/" ;;
esac
"""


@dataclass
class Machine:
    """A sandbox: `bin` is the whole PATH; `available` holds what apt-get can install."""

    root: Path

    @property
    def bin(self) -> Path:
        return self.root / "bin"

    def has(self, *commands: str) -> Machine:
        for command in commands:
            shutil.copy(self.root / "available" / command, self.bin / command)
        return self

    def run(self, *services: str) -> tuple[int, str]:
        env = {"PATH": str(self.bin), "SANDBOX": str(self.root), "CI_SERVICES_WAIT_SECONDS": "1"}
        env["PG_LIB"] = str(self.root / "lib")
        env["CI_SBIN"] = str(self.root / "sbin")  # none: the machine's /usr/sbin is not ours
        done = subprocess.run(
            ["bash", str(SCRIPT), *services],
            env=env,
            capture_output=True,
            text=True,
            timeout=30,
            executable=shutil.which("bash"),
        )
        return done.returncode, done.stdout + done.stderr

    def calls(self) -> list[str]:
        path = self.root / "calls"
        return path.read_text().splitlines() if path.exists() else []


def stand_in(path: Path, body: str) -> None:
    path.write_text(f"#!{shutil.which('bash')}\n{body}\n")
    path.chmod(0o755)


@pytest.fixture
def machine(tmp_path: Path) -> Machine:
    """A root machine with apt-get and no PostgreSQL, no chromium (yet)."""
    found = Machine(tmp_path)
    found.bin.mkdir()
    (tmp_path / "available").mkdir()
    (tmp_path / "lib" / "15").mkdir(parents=True)
    for tool in TOOLS:
        real = shutil.which(tool)
        assert real is not None, tool
        os.symlink(real, found.bin / tool)
    for name, body in STANDINS.items():
        stand_in(tmp_path / "available" / name, body)
    stand_in(tmp_path / "available" / "apt-get", APT_GET)
    stand_in(tmp_path / "available" / "chromium", "exit 0")
    stand_in(tmp_path / "available" / "pgbouncer", "exit 0")
    (tmp_path / "uid").write_text("0\n")
    (tmp_path / "apt-works").touch()
    return found.has("id", "apt-get")


def test_on_this_machine_a_postgresql_that_answers_is_left_as_it_is() -> None:
    ready = shutil.which("pg_isready")
    if ready is None or subprocess.run([ready, "-h", "127.0.0.1", "-q"], check=False).returncode:
        pytest.skip("no PostgreSQL answering on 127.0.0.1:5432 here")
    done = subprocess.run([str(SCRIPT), "postgresql"], capture_output=True, text=True, timeout=30)

    assert (done.returncode, done.stdout, done.stderr) == (0, "", "")


def test_a_server_that_answers_is_left_as_it_is(machine: Machine) -> None:
    machine.has("pg_isready", "pg_lsclusters", "pg_ctlcluster", "chromium", "pgbouncer")
    (machine.root / "up").touch()

    assert machine.run() == (0, "")
    assert machine.calls() == []


def test_a_cluster_that_is_down_is_started(machine: Machine) -> None:
    machine.has("pg_isready", "pg_lsclusters", "pg_ctlcluster")
    (machine.root / "clusters").write_text(CLUSTER)

    code, output = machine.run("postgresql")

    assert code == 0, output
    assert machine.calls() == ["pg_ctlcluster --skip-systemctl-redirect 15 main start"]


def test_no_cluster_creates_one_with_trust_auth_on_5432(machine: Machine) -> None:
    machine.has("pg_isready", "pg_lsclusters", "pg_ctlcluster", "pg_createcluster")

    code, output = machine.run("postgresql")

    assert code == 0, output
    assert machine.calls() == [
        "pg_createcluster -p 5432 15 main -- --auth=trust",
        "pg_ctlcluster --skip-systemctl-redirect 15 main start",
    ]


def test_no_postgresql_installs_it_and_replaces_its_password_cluster(machine: Machine) -> None:
    code, output = machine.run("postgresql")

    assert code == 0, output
    assert machine.calls() == [
        "apt-get -qq update",
        "apt-get -qq install -y postgresql",
        "pg_dropcluster --stop 15 main",
        "pg_createcluster -p 5432 15 main -- --auth=trust",
        "pg_ctlcluster --skip-systemctl-redirect 15 main start",
    ]


def test_postgresql_that_cannot_be_installed_fails_saying_so(machine: Machine) -> None:
    (machine.root / "apt-works").unlink()

    code, output = machine.run()

    assert code == 1
    assert "ci: PostgreSQL is not installed and could not be" in output


def test_not_root_without_sudo_nothing_is_installed_and_it_fails(machine: Machine) -> None:
    (machine.root / "uid").write_text("1000\n")

    code, output = machine.run("postgresql")

    assert code == 1 and "apt-get install -y postgresql, as root" in output
    assert machine.calls() == []


def test_a_cluster_that_will_not_answer_fails_naming_the_port(machine: Machine) -> None:
    machine.has("pg_isready", "pg_lsclusters", "pg_ctlcluster")
    stand_in(machine.bin / "pg_ctlcluster", 'echo "pg_ctlcluster $*" >>"$SANDBOX/calls"; exit 1')
    (machine.root / "clusters").write_text(CLUSTER)

    code, output = machine.run("postgresql")

    assert code == 1
    assert "ci: PostgreSQL does not answer on 127.0.0.1:5432" in output


def test_missing_chromium_is_installed(machine: Machine) -> None:
    code, output = machine.run("chromium")

    assert code == 0, output
    assert machine.calls() == ["apt-get -qq update", "apt-get -qq install -y chromium"]
    assert (machine.bin / "chromium").exists()


def test_chromium_that_cannot_be_installed_fails_saying_so(machine: Machine) -> None:
    (machine.root / "apt-works").unlink()

    code, output = machine.run("chromium")

    assert code == 1
    assert "ci: no chromium, and it could not be installed" in output


def test_chromium_there_already_installs_nothing(machine: Machine) -> None:
    machine.has("chromium")

    assert machine.run("chromium") == (0, "")
    assert machine.calls() == []


def test_missing_pgbouncer_is_installed(machine: Machine) -> None:
    code, output = machine.run("pgbouncer")

    assert code == 0, output
    assert machine.calls() == ["apt-get -qq update", "apt-get -qq install -y pgbouncer"]
    assert (machine.bin / "pgbouncer").exists()


def test_pgbouncer_that_cannot_be_installed_fails_saying_so(machine: Machine) -> None:
    (machine.root / "apt-works").unlink()

    code, output = machine.run("pgbouncer")

    assert code == 1
    assert "ci: no pgbouncer, and it could not be installed" in output


def test_ci_run_starts_the_services_before_the_suite_and_sets_ci() -> None:
    """.ci/run itself runs the whole suite, so only its order is checked here."""
    lines = (REPO / ".ci" / "run").read_text().splitlines()

    services, ci, tests = (
        lines.index(".ci/services"),
        lines.index('export CI="${CI:-true}"'),
        lines.index("make test"),
    )
    assert services < ci < tests
    assert not [line for line in lines if "will skip" in line or "SQLite only" in line]
