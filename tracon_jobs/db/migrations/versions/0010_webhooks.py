"""Webhooks: endpoints per tenant, the outbox of events, deliveries and their attempts; the
Slack messages that asked for approvals.

Revision ID: 0010
Revises: 0009
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "webhook_endpoints",
        sa.Column("id", sa.String(36), primary_key=True),
        sa.Column("tenant_id", sa.String(36), sa.ForeignKey("tenants.id"), nullable=False),
        sa.Column("url", sa.String(2000), nullable=False),
        sa.Column("events", sa.JSON(), nullable=False),
        sa.Column("description", sa.Text(), nullable=True),
        sa.Column("secret", sa.String(100), nullable=False),
        sa.Column("previous_secret", sa.String(100), nullable=True),
        sa.Column("previous_secret_until", sa.DateTime(), nullable=True),
        sa.Column("enabled", sa.Boolean(), nullable=False),
        sa.Column("disabled_at", sa.DateTime(), nullable=True),
        sa.Column("disabled_reason", sa.String(200), nullable=True),
        sa.Column("failing_since", sa.DateTime(), nullable=True),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("updated_at", sa.DateTime(), nullable=False),
    )
    op.create_index(
        "ix_webhook_endpoints_tenant", "webhook_endpoints", ["tenant_id", "created_at", "id"]
    )
    op.create_table(
        "webhook_messages",
        sa.Column("id", sa.String(40), primary_key=True),
        sa.Column("tenant_id", sa.String(36), nullable=True),
        sa.Column("type", sa.String(60), nullable=False),
        sa.Column("subject_id", sa.String(200), nullable=True),
        sa.Column("data", sa.JSON(), nullable=False),
        sa.Column("dedupe_key", sa.String(300), nullable=True, unique=True),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("body", sa.Text(), nullable=True),
        sa.Column("fanned_at", sa.DateTime(), nullable=True),
        sa.Column("claim_until", sa.DateTime(), nullable=True),
    )
    op.create_index("ix_webhook_messages_fanned", "webhook_messages", ["fanned_at", "created_at"])
    op.create_table(
        "webhook_deliveries",
        sa.Column("id", sa.String(36), primary_key=True),
        sa.Column(
            "message_id", sa.String(40), sa.ForeignKey("webhook_messages.id"), nullable=False
        ),
        sa.Column("target", sa.String(36), nullable=False),
        sa.Column("tenant_id", sa.String(36), nullable=True),
        sa.Column("status", sa.String(20), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("next_attempt_at", sa.DateTime(), nullable=False),
        sa.Column("claimed_by", sa.String(200), nullable=True),
        sa.Column("claim_until", sa.DateTime(), nullable=True),
        sa.Column("last_status", sa.Integer(), nullable=True),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("delivered_at", sa.DateTime(), nullable=True),
        sa.UniqueConstraint("message_id", "target", name="uq_webhook_deliveries_message_target"),
    )
    op.create_index(
        "ix_webhook_deliveries_due", "webhook_deliveries", ["status", "next_attempt_at"]
    )
    op.create_index(
        "ix_webhook_deliveries_target", "webhook_deliveries", ["target", "created_at", "id"]
    )
    op.create_table(
        "webhook_attempts",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column(
            "delivery_id", sa.String(36), sa.ForeignKey("webhook_deliveries.id"), nullable=False
        ),
        sa.Column("attempted_at", sa.DateTime(), nullable=False),
        sa.Column("status", sa.Integer(), nullable=True),
        sa.Column("latency_ms", sa.Integer(), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("response", sa.Text(), nullable=True),
    )
    op.create_index("ix_webhook_attempts_delivery", "webhook_attempts", ["delivery_id", "id"])
    op.create_table(
        "slack_messages",
        sa.Column("approval_id", sa.String(36), sa.ForeignKey("approvals.id"), primary_key=True),
        sa.Column("channel", sa.String(100), nullable=False),
        sa.Column("ts", sa.String(40), nullable=False),
        sa.Column("posted_at", sa.DateTime(), nullable=False),
        sa.Column("updated_status", sa.String(20), nullable=True),
    )


def downgrade() -> None:
    op.drop_table("slack_messages")
    op.drop_index("ix_webhook_attempts_delivery", "webhook_attempts")
    op.drop_table("webhook_attempts")
    op.drop_index("ix_webhook_deliveries_target", "webhook_deliveries")
    op.drop_index("ix_webhook_deliveries_due", "webhook_deliveries")
    op.drop_table("webhook_deliveries")
    op.drop_index("ix_webhook_messages_fanned", "webhook_messages")
    op.drop_table("webhook_messages")
    op.drop_index("ix_webhook_endpoints_tenant", "webhook_endpoints")
    op.drop_table("webhook_endpoints")
