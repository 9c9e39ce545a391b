"""Fair dispatch: a run's priority (0-9, 5 by default) and a tenant's weight
(`tracon-jobs tenants weight`; NULL: 1).

Revision ID: 0009
Revises: 0008
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.add_column(sa.Column("priority", sa.Integer(), nullable=False, server_default="5"))
    with op.batch_alter_table("tenants") as batch:
        batch.add_column(sa.Column("weight", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("tenants") as batch:
        batch.drop_column("weight")
    with op.batch_alter_table("runs") as batch:
        batch.drop_column("priority")
