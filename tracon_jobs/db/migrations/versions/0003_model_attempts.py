"""Per-link model attempts and the provider's Retry-After on the run.

Revision ID: 0003
Revises: 0002
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.add_column(sa.Column("model_attempts", sa.JSON(), nullable=True))
        batch.add_column(sa.Column("error_retry_after", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.drop_column("error_retry_after")
        batch.drop_column("model_attempts")
