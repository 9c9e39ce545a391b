"""`.ci/services nftables`, which `.ci/run` asks for before the suite so that the partition
tests (tests/e2e/test_partition_processes.py) run in CI: on a sandbox machine whose `PATH`
holds only the shell's own tools and stand-ins for `id`, `apt-get`, `nft` and `ip`, each
logging its call (as tests/integration/test_ci_services.py does for the other services)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.e2e.cluster import REPO

pytestmark = pytest.mark.timeout(60)

SCRIPT = REPO / ".ci" / "services"
TOOLS = ["bash", "env", "timeout", "cat", "cp"]
APT_GET = """
echo "apt-get $*" >>"$SANDBOX/calls"
[ -e "$SANDBOX/apt-works" ] || exit 100
case "$*" in
  *"install -y nftables iproute2"*) cp "$SANDBOX/available/nft" "$SANDBOX/available/ip" \\
    "$SANDBOX/bin/" ;;
esac
"""


def stand_in(path: Path, body: str) -> None:
    path.write_text(f"#!{shutil.which('bash')}\n{body}\n")
    path.chmod(0o755)


@pytest.fixture
def sandbox(tmp_path: Path) -> Path:
    """A root machine with apt-get, without nft or ip (yet)."""
    (tmp_path / "bin").mkdir()
    (tmp_path / "available").mkdir()
    for tool in TOOLS:
        real = shutil.which(tool)
        assert real is not None, tool
        os.symlink(real, tmp_path / "bin" / tool)
    stand_in(tmp_path / "bin" / "id", "echo 0")
    stand_in(tmp_path / "bin" / "apt-get", APT_GET)
    stand_in(tmp_path / "available" / "nft", "exit 0")
    stand_in(tmp_path / "available" / "ip", "exit 0")
    (tmp_path / "apt-works").touch()
    return tmp_path


def run(sandbox: Path) -> tuple[int, str, list[str]]:
    """`.ci/services nftables` on the sandbox: its exit code, its output, the calls made."""
    env = {"PATH": str(sandbox / "bin"), "SANDBOX": str(sandbox)}
    env["CI_SBIN"] = str(sandbox / "sbin")  # none: the machine's /usr/sbin is not ours
    done = subprocess.run(
        ["bash", str(SCRIPT), "nftables"],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
        executable=shutil.which("bash"),
    )
    calls = sandbox / "calls"
    logged = calls.read_text().splitlines() if calls.exists() else []
    return done.returncode, done.stdout + done.stderr, logged


def test_missing_nftables_is_installed(sandbox: Path) -> None:
    code, output, calls = run(sandbox)

    assert code == 0, output
    assert calls == ["apt-get -qq update", "apt-get -qq install -y nftables iproute2"]
    assert (sandbox / "bin" / "nft").exists()


def test_nftables_that_cannot_be_installed_fails_saying_so(sandbox: Path) -> None:
    (sandbox / "apt-works").unlink()

    code, output, _ = run(sandbox)

    assert code != 0
    assert "ci: no nft, and it could not be installed" in output


def test_nftables_there_already_installs_nothing(sandbox: Path) -> None:
    for tool in ("nft", "ip"):
        shutil.copy(sandbox / "available" / tool, sandbox / "bin" / tool)

    code, output, calls = run(sandbox)

    assert (code, calls) == (0, []), output


def test_ci_run_asks_for_nftables_before_the_suite() -> None:
    lines = (REPO / ".ci" / "run").read_text().splitlines()

    assert lines.index(".ci/services nftables") < lines.index("make test")
