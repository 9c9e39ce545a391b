"""Approvals: a person between the model and a tool call; runs remember when they waited.

Revision ID: 0004
Revises: 0003
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "approvals",
        sa.Column("id", sa.String(36), primary_key=True),
        sa.Column("tenant_id", sa.String(36), sa.ForeignKey("tenants.id"), nullable=False),
        sa.Column("run_id", sa.String(36), sa.ForeignKey("runs.id"), nullable=False),
        sa.Column("turn", sa.Integer(), nullable=False),
        sa.Column("call_id", sa.String(200), nullable=False),
        sa.Column("tool", sa.String(200), nullable=False),
        sa.Column("arguments", sa.JSON(), nullable=False),
        sa.Column("args_hash", sa.String(64), nullable=False),
        sa.Column("execution_id", sa.String(36), nullable=False),
        sa.Column("status", sa.String(20), nullable=False),
        sa.Column("requested_at", sa.DateTime(), nullable=False),
        sa.Column("expires_at", sa.DateTime(), nullable=False),
        sa.Column("decided_at", sa.DateTime(), nullable=True),
        sa.Column("decided_by", sa.String(200), nullable=True),
        sa.Column("comment", sa.Text(), nullable=True),
        sa.Column("consumed_at", sa.DateTime(), nullable=True),
        sa.UniqueConstraint("run_id", "turn", "call_id", name="uq_approvals_run_turn_call"),
    )
    op.create_index(
        "ix_approvals_tenant_status_requested",
        "approvals",
        ["tenant_id", "status", "requested_at", "id"],
    )
    op.create_index(
        "ix_approvals_tenant_requested", "approvals", ["tenant_id", "requested_at", "id"]
    )
    op.create_index("ix_approvals_status_expires", "approvals", ["status", "expires_at"])
    op.create_index("ix_approvals_run_tool_args", "approvals", ["run_id", "tool", "args_hash"])
    with op.batch_alter_table("runs") as batch:
        batch.add_column(sa.Column("waiting_since", sa.DateTime(), nullable=True))
        batch.add_column(
            sa.Column("waited_ms", sa.BigInteger(), nullable=False, server_default="0")
        )


def downgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.drop_column("waited_ms")
        batch.drop_column("waiting_since")
    op.drop_table("approvals")
