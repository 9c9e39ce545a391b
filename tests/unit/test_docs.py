"""The docs hold together: the README stays a front door, every relative link lands on a file
(and on a heading, for an anchor), and the README's code map names every top-level folder."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
README_MAX_BYTES = 15_000

FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"`+[^`\n]*`+")
INLINE_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_LINK = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.MULTILINE)
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:|^//")


def markdown_files() -> list[Path]:
    return [README, ROOT / "CHANGES.md", *sorted((ROOT / "docs").glob("*.md"))]


def prose(text: str) -> str:
    """The text outside code blocks and code spans, where links and headings live."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text, lowercased, punctuation dropped, spaces as -."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"[`*_~]|<[^>]+>", "", text).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading's anchor in a Markdown file, with GitHub's -1, -2 suffixes for repeats."""
    text = FENCE.sub("", path.read_text(encoding="utf-8"))
    seen: dict[str, int] = {}
    found: set[str] = set()
    for heading in HEADING.findall(text):
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def relative_links(path: Path) -> list[str]:
    text = prose(path.read_text(encoding="utf-8"))
    targets = INLINE_LINK.findall(text) + REFERENCE_LINK.findall(text)
    return [target for target in targets if not SCHEME.match(target)]


def broken(path: Path, target: str) -> str | None:
    """Why a relative link from `path` does not resolve, or None when it does."""
    file_part, _, anchor = target.partition("#")
    destination = (path.parent / file_part).resolve() if file_part else path
    if not destination.exists():
        return "no such file"
    if anchor and destination.suffix == ".md" and anchor not in anchors(destination):
        return f"no heading #{anchor} in {destination.relative_to(ROOT)}"
    return None


def code_map(readme: str) -> str:
    match = re.search(r"^## Code map\s*$(.*?)(?=^## |\Z)", readme, re.MULTILINE | re.DOTALL)
    assert match is not None, "README.md has no '## Code map' section"
    return match.group(1)


def tracked_top_level_folders() -> set[str]:
    try:
        listed = subprocess.run(
            ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    folders = {line.split("/")[0] for line in listed.splitlines() if "/" in line}
    return {folder for folder in folders if not folder.startswith(".")}


def test_readme_is_a_front_door() -> None:
    size = README.stat().st_size
    assert size < README_MAX_BYTES, f"README.md is {size} bytes; move reference text to docs/"


def test_relative_links_resolve() -> None:
    problems = [
        f"{path.relative_to(ROOT)}: ({target}) {reason}"
        for path in markdown_files()
        for target in relative_links(path)
        if (reason := broken(path, target)) is not None
    ]
    assert problems == [], "broken links:\n" + "\n".join(problems)


def test_code_map_names_every_top_level_folder() -> None:
    section = code_map(README.read_text(encoding="utf-8"))
    missing = sorted(f for f in tracked_top_level_folders() if f"`{f}/`" not in section)
    assert missing == [], f"the README's code map does not name: {missing}"


def test_slug_follows_github() -> None:
    assert slug("Heartbeats, orphans and continuation") == "heartbeats-orphans-and-continuation"
    assert slug("`@tool`") == "tool"
    assert slug("Tools: the Python API") == "tools-the-python-api"
