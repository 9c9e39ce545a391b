"""What the commands share: the runtime built from the environment's settings, the local
`var` directory, database URLs fit to print, and the error an operator command fails with."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy.engine import make_url

from tracon_jobs.settings import load_settings

if TYPE_CHECKING:
    from tracon_jobs.runtime import Runtime

VAR = Path("var")
"""Local state of the processes started in this directory (beat's schedule, dev's Redis)."""


class CommandError(Exception):
    """An operator command that cannot do what was asked (exit code 1)."""


def load_runtime() -> Runtime:
    """The runtime of the settings in the environment (`TRACON_CONFIG`, `TRACON_*`)."""
    from tracon_jobs.runtime import Runtime

    settings = load_settings()
    ensure_database_dir(settings.database.url)
    return Runtime(settings)


def ensure_database_dir(url: str) -> None:
    """Create the folder of a SQLite database file, which SQLite will not do itself (a fresh
    clone has no `var/`); other databases, and in-memory SQLite, need nothing."""
    parsed = make_url(url)
    database = parsed.database
    if parsed.get_backend_name() != "sqlite" or not database or database == ":memory:":
        return
    if database.startswith("file:"):  # a SQLite URI filename: file:path?mode=...
        database = database[len("file:") :].split("?", 1)[0]
        if not database or database.startswith(":memory:"):
            return
    Path(database).parent.mkdir(parents=True, exist_ok=True)


def safe_url(url: str) -> str:
    """`url` with its password hidden."""
    return make_url(url).render_as_string(hide_password=True)
