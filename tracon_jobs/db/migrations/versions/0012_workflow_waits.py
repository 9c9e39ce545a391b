"""Workflows that wait on the world: a waiting node's `due_at` (a durable timer's time, an
event wait's timeout; the timer scan's index), and the events delivered to a workflow before
it waits for them (`workflow_events`, consumed once each, oldest first).

Revision ID: 0012
Revises: 0011
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("workflow_nodes") as batch:
        batch.add_column(sa.Column("due_at", sa.DateTime(), nullable=True))
    op.create_index("ix_workflow_nodes_status_due", "workflow_nodes", ["status", "due_at"])
    op.create_table(
        "workflow_events",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("tenant_id", sa.String(36), sa.ForeignKey("tenants.id"), nullable=False),
        sa.Column("chain_id", sa.String(36), sa.ForeignKey("runs.id"), nullable=False),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("payload", sa.JSON(), nullable=True),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("consumed_at", sa.DateTime(), nullable=True),
        sa.Column("consumed_by", sa.String(36), nullable=True),
    )
    op.create_index(
        "ix_workflow_events_waiting", "workflow_events", ["chain_id", "name", "consumed_at", "id"]
    )


def downgrade() -> None:
    op.drop_index("ix_workflow_events_waiting", table_name="workflow_events")
    op.drop_table("workflow_events")
    op.drop_index("ix_workflow_nodes_status_due", table_name="workflow_nodes")
    with op.batch_alter_table("workflow_nodes") as batch:
        batch.drop_column("due_at")
