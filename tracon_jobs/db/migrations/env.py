"""Alembic environment: online migrations only, with batch mode so SQLite can alter tables."""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine, pool

from tracon_jobs.db.engine import Database
from tracon_jobs.db.migrate import PREPARED_STATEMENTS
from tracon_jobs.db.models import Base

config = context.config
url = config.get_main_option("sqlalchemy.url")
assert url, "sqlalchemy.url must be set by tracon_jobs.db.migrate"
prepared = config.get_main_option(PREPARED_STATEMENTS, "true") == "true"

# the URL and connect options the processes use (several hosts, prepared statements)
url, connect_args = Database(url, prepared_statements=prepared).connect_options()
engine = create_engine(url, poolclass=pool.NullPool, connect_args=connect_args)
with engine.connect() as connection:
    context.configure(
        connection=connection,
        target_metadata=Base.metadata,
        render_as_batch=connection.dialect.name == "sqlite",
    )
    with context.begin_transaction():
        context.run_migrations()
engine.dispose()
