"""Safe deploys: a workflow run's `workflow_version`, the code version of the workflow that
executed it (declared, or a hash of its module's source; NULL for agent runs and for runs
written before it was recorded).

Revision ID: 0013
Revises: 0012
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.add_column(sa.Column("workflow_version", sa.String(length=64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.drop_column("workflow_version")
