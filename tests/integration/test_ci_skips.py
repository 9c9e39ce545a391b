"""A suite that lacks its service skips on a developer's machine and fails under CI: a
pytest session of its own (a subprocess, with this suite's fixtures as a plugin) on a
PostgreSQL URL nobody listens on, and on a chromium path that does not exist."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.cluster import REPO
from tracon_jobs.embedded_redis import free_port

pytestmark = pytest.mark.timeout(120)

NEEDS_POSTGRES = """
def test_needs_a_database(sql_url):
    assert sql_url
"""
NEEDS_CHROMIUM = """
from pathlib import Path

import tests.browser.conftest as browser_suite

browser_suite.CHROMIUM = Path("/nonexistent/chromium")


def test_needs_a_browser(browser):
    assert browser
"""


def session(tmp_path: Path, test: str, plugin: str, ci: str | None) -> tuple[int, str]:
    """A pytest session of `test` with `plugin`'s fixtures, PostgreSQL on a closed port, and
    `CI` set to `ci` (unset when None); its exit code and output."""
    (tmp_path / "test_probe.py").write_text(test)
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "PYTEST_ADDOPTS")}
    env["PYTHONPATH"] = str(REPO)
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"  # the fixtures' plugin is all it needs
    env["TRACON_TEST_POSTGRES_URL"] = f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/x"
    if ci is not None:
        env["CI"] = ci
    argv = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", plugin, "-p", "no:randomly"]
    argv += ["-p", "no:cacheprovider", "--rootdir", str(tmp_path), str(tmp_path)]
    done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=90)
    return done.returncode, done.stdout + done.stderr


def test_a_postgresql_test_skips_without_a_server_outside_ci(tmp_path: Path) -> None:
    code, output = session(tmp_path, NEEDS_POSTGRES, "tests.conftest", ci=None)

    assert code == 0, output
    assert "1 passed, 1 skipped" in output, output
    assert "no PostgreSQL server answers at postgresql+psycopg://postgres@127.0.0.1:" in output


@pytest.mark.parametrize("ci", ["true", "1"])
def test_a_postgresql_test_fails_without_a_server_under_ci(tmp_path: Path, ci: str) -> None:
    code, output = session(tmp_path, NEEDS_POSTGRES, "tests.conftest", ci=ci)

    assert code == 1, output
    assert "1 passed, 1 error" in output, "the SQLite half still runs; the PostgreSQL one fails"
    assert "CI is set, so a missing service fails the test" in output, output
    assert "skipped" not in output


def test_ci_false_is_not_ci(tmp_path: Path) -> None:
    code, output = session(tmp_path, NEEDS_POSTGRES, "tests.conftest", ci="false")

    assert code == 0 and "1 passed, 1 skipped" in output, output


def test_a_browser_test_skips_without_chromium_outside_ci(tmp_path: Path) -> None:
    code, output = session(tmp_path, NEEDS_CHROMIUM, "tests.browser.conftest", ci=None)

    assert code == 0, output
    assert "1 skipped" in output and "no chromium at /nonexistent/chromium" in output, output


def test_a_browser_test_fails_without_chromium_under_ci(tmp_path: Path) -> None:
    code, output = session(tmp_path, NEEDS_CHROMIUM, "tests.browser.conftest", ci="true")

    assert code == 1, output
    assert "1 error" in output and "no chromium at /nonexistent/chromium" in output, output
    assert "CI is set, so a missing service fails the test" in output, output
