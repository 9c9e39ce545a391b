"""Schedules: a tenant's runs at the slots of a cron expression or an interval
(`schedules`), and each slot recorded once (`schedule_fires`, keyed by schedule and slot: the
insert that records a slot is what keeps it from firing twice).

Revision ID: 0015
Revises: 0014
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "schedules",
        sa.Column("id", sa.String(36), primary_key=True),
        sa.Column("tenant_id", sa.String(36), sa.ForeignKey("tenants.id"), nullable=False),
        sa.Column("name", sa.String(100), nullable=False),
        sa.Column("cron", sa.String(200), nullable=True),
        sa.Column("timezone", sa.String(64), nullable=False),
        sa.Column("interval_ms", sa.BigInteger(), nullable=True),
        sa.Column("anchor_at", sa.DateTime(), nullable=False),
        sa.Column("target_kind", sa.String(20), nullable=False),
        sa.Column("target_name", sa.String(200), nullable=False),
        sa.Column("input", sa.JSON(), nullable=False),
        sa.Column("overlap", sa.String(20), nullable=False),
        sa.Column("catch_up", sa.String(20), nullable=False),
        sa.Column("paused", sa.Boolean(), nullable=False),
        sa.Column("next_fire_at", sa.DateTime(), nullable=True),
        sa.Column("last_fire_at", sa.DateTime(), nullable=True),
        sa.Column("last_run_id", sa.String(36), nullable=True),
        sa.Column("queued_slot_at", sa.DateTime(), nullable=True),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("updated_at", sa.DateTime(), nullable=False),
        sa.UniqueConstraint("tenant_id", "name", name="uq_schedules_tenant_name"),
    )
    op.create_index("ix_schedules_tenant_created", "schedules", ["tenant_id", "created_at", "id"])
    op.create_index("ix_schedules_next_fire", "schedules", ["next_fire_at"])
    op.create_index("ix_schedules_queued", "schedules", ["queued_slot_at"])
    op.create_table(
        "schedule_fires",
        sa.Column("schedule_id", sa.String(36), sa.ForeignKey("schedules.id"), primary_key=True),
        sa.Column("slot_at", sa.DateTime(), primary_key=True),
        sa.Column("tenant_id", sa.String(36), nullable=False),
        sa.Column("outcome", sa.String(20), nullable=False),
        sa.Column("run_id", sa.String(36), nullable=True),
        sa.Column("fired_at", sa.DateTime(), nullable=False),
        sa.Column("detail", sa.Text(), nullable=True),
    )
    op.create_index("ix_schedule_fires_run", "schedule_fires", ["run_id"])


def downgrade() -> None:
    op.drop_index("ix_schedule_fires_run", table_name="schedule_fires")
    op.drop_table("schedule_fires")
    op.drop_index("ix_schedules_queued", table_name="schedules")
    op.drop_index("ix_schedules_next_fire", table_name="schedules")
    op.drop_index("ix_schedules_tenant_created", table_name="schedules")
    op.drop_table("schedules")
