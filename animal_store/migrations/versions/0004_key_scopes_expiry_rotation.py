"""API keys with scopes, an expiry, and a previous key that works until its grace ends.

Revision ID: 0004
Revises: 0003
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("api_keys") as batch:
        # Existing keys keep full access.
        batch.add_column(
            sa.Column("scopes", sa.String(50), nullable=False, server_default="read,write")
        )
        batch.add_column(sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True))
        batch.add_column(sa.Column("previous_key_hash", sa.LargeBinary(32), nullable=True))
        batch.add_column(sa.Column("previous_prefix", sa.String(16), nullable=True))
        batch.add_column(
            sa.Column("previous_key_expires_at", sa.DateTime(timezone=True), nullable=True)
        )
        batch.create_unique_constraint("uq_api_keys_previous_key_hash", ["previous_key_hash"])


def downgrade() -> None:
    with op.batch_alter_table("api_keys") as batch:
        batch.drop_constraint("uq_api_keys_previous_key_hash", type_="unique")
        for column in (
            "previous_key_expires_at",
            "previous_prefix",
            "previous_key_hash",
            "expires_at",
            "scopes",
        ):
            batch.drop_column(column)
