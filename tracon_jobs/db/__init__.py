"""SQL storage: SQLAlchemy 2 tables, engines and the Alembic migration history."""

from tracon_jobs.db.engine import Database

__all__ = ["Database"]
