"""The docs' code that says it runs does run: every fenced block of README.md and docs/*.md whose
info string holds the word `runnable` (```` ```python runnable ````, ```` ```json runnable ````)
is run or checked, and a block that does not hold fails the test that names it
(`docs/tools.md:9`).

- `python`: run as a script by a fresh interpreter of this checkout, in an empty working
  directory, so that blocks share nothing (each registers its tools and workflows in a process
  of its own); it must exit 0 within `BLOCK_TIMEOUT`. Its `assert`s are the docs' claims.
- `json`: a configuration document, `{"Tracon": {...}}`, checked as startup checks a
  configuration file: `Settings` (keys, types, ranges, the references between sections) and
  the rules between sections. The environment is not read and modules are not imported, so a
  block may name a variable or a module of the reader's.

Any other language marked runnable fails: the marker never silently does nothing.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tracon_jobs.errors import ConfigurationError
from tracon_jobs.runtime import check_workflow_settings
from tracon_jobs.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
MARKER = "runnable"
BLOCK_TIMEOUT = 60
FENCE_OPEN = re.compile(r"^(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
LEAST_BLOCKS = 8
LEAST_FILES = 4
"""The docs mark at least this many blocks in this many files: a marker lost in an edit (or a
parser that stopped finding them) fails here instead of passing with nothing run."""


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    language: str
    code: str

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def fenced_blocks(path: Path) -> list[Block]:
    """Every fenced block of a Markdown file whose info string holds the marker."""
    lines = path.read_text(encoding="utf-8").splitlines()
    found: list[Block] = []
    index = 0
    while index < len(lines):
        opening = FENCE_OPEN.match(lines[index])
        if opening is None:
            index += 1
            continue
        fence, words = opening["fence"], opening["info"].split()
        end = index + 1
        while end < len(lines) and not lines[end].startswith(fence):
            end += 1
        if MARKER in words:
            language = words[0] if words[0] != MARKER else ""
            code = "\n".join(lines[index + 1 : end]) + "\n"
            found.append(Block(path, index + 1, language, code))
        index = end + 1
    return found


def marked_blocks() -> list[Block]:
    return [block for path in doc_files() for block in fenced_blocks(path)]


def run_python(block: Block, workdir: Path) -> str | None:
    """Why the block failed as a script, or None when it exited 0."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    try:
        done = subprocess.run(
            [sys.executable, "-c", block.code],
            cwd=workdir,
            env=env,
            capture_output=True,
            text=True,
            timeout=BLOCK_TIMEOUT,
        )
    except subprocess.TimeoutExpired:
        return f"still running after {BLOCK_TIMEOUT} s"
    if done.returncode != 0:
        return f"exit {done.returncode}:\n{done.stderr.strip()}"
    return None


def check_configuration(block: Block) -> str | None:
    """Why the block is not a valid configuration document, or None when it is."""
    try:
        document = json.loads(block.code)
    except json.JSONDecodeError as exc:
        return f"not JSON: {exc}"
    if not isinstance(document, dict) or list(document) != ["Tracon"]:
        return 'a configuration document has one root object, "Tracon"'
    try:
        check_workflow_settings(Settings.from_mapping(document["Tracon"]))
    except ConfigurationError as exc:
        return str(exc)
    return None


def failure(block: Block, workdir: Path) -> str | None:
    if block.language == "python":
        return run_python(block, workdir)
    if block.language == "json":
        return check_configuration(block)
    return f"'{block.language or 'no language'}' blocks cannot be marked {MARKER} (python, json)"


@pytest.mark.parametrize("block", marked_blocks(), ids=lambda block: block.where)
def test_a_marked_block_runs(block: Block, tmp_path: Path) -> None:
    problem = failure(block, tmp_path)
    assert problem is None, f"{block.where} ({block.language}) does not hold: {problem}"


def test_the_docs_mark_blocks_in_several_files() -> None:
    blocks = marked_blocks()
    files = {block.path for block in blocks}
    assert len(blocks) >= LEAST_BLOCKS and len(files) >= LEAST_FILES, (
        f"{len(blocks)} blocks in {len(files)} files are marked {MARKER}"
    )
    assert {block.language for block in blocks} == {"python", "json"}


def test_a_block_that_does_not_hold_is_reported(tmp_path: Path) -> None:
    # Given a page with a failing script, an invalid configuration and an unknown language
    page = tmp_path / "page.md"
    page.write_text(
        "Text.\n\n```python runnable\nraise SystemExit('no refund')\n```\n\n"
        "```python\nraise SystemExit('not marked')\n```\n\n"
        '~~~json runnable\n{"Tracon": {"CircuitBreaker": {"FailureTreshold": 5}}}\n~~~\n\n'
        "```bash runnable\ntrue\n```\n",
        encoding="utf-8",
    )
    blocks = [Block(ROOT / "page.md", b.line, b.language, b.code) for b in fenced_blocks(page)]

    # When each marked block is run or checked
    problems = [failure(block, tmp_path) for block in blocks]

    # Then the unmarked block is left out, and each marked one fails saying why
    assert [(block.line, block.language) for block in blocks] == [
        (3, "python"),
        (11, "json"),
        (15, "bash"),
    ]
    script, configuration, unknown = problems
    assert script is not None and script.startswith("exit 1") and "no refund" in script
    assert configuration is not None and 'did you mean "FailureThreshold"' in configuration
    assert unknown is not None and "cannot be marked runnable" in unknown
