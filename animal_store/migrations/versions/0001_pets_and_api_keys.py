"""Pets and API keys.

Revision ID: 0001
Revises:
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

# BIGINT identity on PostgreSQL; INTEGER PRIMARY KEY (the 64-bit rowid) on SQLite.
int64_id = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "pets",
        sa.Column("id", int64_id, sa.Identity(always=False), primary_key=True),
        sa.Column("name", sa.String(255), nullable=False),
        sa.Column("category_id", sa.BigInteger(), nullable=False),
        sa.Column(
            "status",
            sa.Enum(
                "available",
                "pending",
                "sold",
                name="pet_status",
                native_enum=False,
                create_constraint=True,
            ),
            nullable=True,
        ),
    )
    op.create_table(
        "api_keys",
        sa.Column("id", int64_id, sa.Identity(always=False), primary_key=True),
        sa.Column("name", sa.String(100), nullable=False, unique=True),
        sa.Column("prefix", sa.String(16), nullable=False),
        sa.Column("key_hash", sa.LargeBinary(32), nullable=False, unique=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_used_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
    )


def downgrade() -> None:
    op.drop_table("api_keys")
    op.drop_table("pets")
