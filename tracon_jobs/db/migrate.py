"""Run the Alembic history (the same one on SQLite and PostgreSQL) up to head."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config

from tracon_jobs.db.engine import normalize_url

MIGRATIONS = Path(__file__).with_name("migrations")


def alembic_config(url: str) -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    config.set_main_option("sqlalchemy.url", normalize_url(url).replace("%", "%%"))
    return config


def upgrade(url: str, revision: str = "head") -> None:
    command.upgrade(alembic_config(url), revision)
