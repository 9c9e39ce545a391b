"""Run the Alembic history (the same one on SQLite and PostgreSQL) up to head."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config

from tracon_jobs.db.engine import normalize_url

MIGRATIONS = Path(__file__).with_name("migrations")


PREPARED_STATEMENTS = "tracon.prepared_statements"
"""The Alembic option that carries `Database.PreparedStatements` to `migrations/env.py`."""


def alembic_config(url: str, *, prepared_statements: bool = True) -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    config.set_main_option("sqlalchemy.url", normalize_url(url).replace("%", "%%"))
    config.set_main_option(PREPARED_STATEMENTS, "true" if prepared_statements else "false")
    return config


def upgrade(url: str, revision: str = "head", *, prepared_statements: bool = True) -> None:
    """Migrate `url` to `revision`; `prepared_statements` as `Database.PreparedStatements`
    (off through a pooler in transaction mode)."""
    command.upgrade(alembic_config(url, prepared_statements=prepared_statements), revision)
