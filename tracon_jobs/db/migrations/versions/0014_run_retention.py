"""Run retention: a tenant's own `Runs.Retention` (`tracon-jobs tenants retention`; NULL: the
setting's, 0: keep forever), and the indexes the retention pass reads and deletes by: a
tenant's runs by their end, the runs that continue a chain, and the idempotency records
that name a run.

Revision ID: 0014
Revises: 0013
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("tenants") as batch:
        batch.add_column(sa.Column("retention_seconds", sa.BigInteger(), nullable=True))
    op.create_index("ix_runs_tenant_ended", "runs", ["tenant_id", "ended_at", "id"])
    op.create_index("ix_runs_continued_from", "runs", ["continued_from_run_id"])
    op.create_index("ix_idempotency_records_run", "idempotency_records", ["run_id"])


def downgrade() -> None:
    op.drop_index("ix_idempotency_records_run", table_name="idempotency_records")
    op.drop_index("ix_runs_continued_from", table_name="runs")
    op.drop_index("ix_runs_tenant_ended", table_name="runs")
    with op.batch_alter_table("tenants") as batch:
        batch.drop_column("retention_seconds")
