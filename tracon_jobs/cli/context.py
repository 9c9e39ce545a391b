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

    return Runtime(load_settings())


def safe_url(url: str) -> str:
    """`url` with its password hidden."""
    return make_url(url).render_as_string(hide_password=True)
