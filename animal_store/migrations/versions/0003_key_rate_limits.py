"""A rate limit of its own for an API key.

Revision ID: 0003
Revises: 0002
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # NULL: the key has the service's RATE_LIMIT, as every existing key keeps.
    with op.batch_alter_table("api_keys") as batch:
        batch.add_column(sa.Column("rate_limit", sa.String(100), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("api_keys") as batch:
        batch.drop_column("rate_limit")
