"""Idempotency-Keys scoped to the request they were first used with: its method and path.

Revision ID: 0007
Revises: 0006

A record gets `target_hash`, SHA-256 of "METHOD path" (idempotency.request_target), and the key is
unique per API key and target instead of per API key alone. Every record stored before this
migration was made by `POST /v1/pets`, the only operation that took an Idempotency-Key, so each
gets that target: a retry of such a creation after the upgrade is still replayed, and its key is
still refused with another body. The hash is written out here, not computed by the app's code,
so this migration keeps doing what it does if that code changes.

Downgrade: records of any other request are deleted first (the old table cannot tell them from a
pets' record with the same key, and its unique constraint would refuse them); those of
`POST /v1/pets` keep working as before. The code from before this migration does not write the
new column: upgrade, then restart the instances.
"""

import hashlib

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

CREATE_PET = hashlib.sha256(b"POST /v1/pets").digest()
records = sa.table("idempotency_records", sa.column("target_hash", sa.LargeBinary(32)))


def upgrade() -> None:
    with op.batch_alter_table("idempotency_records") as batch:
        batch.add_column(sa.Column("target_hash", sa.LargeBinary(32), nullable=True))
    op.execute(records.update().values(target_hash=CREATE_PET))
    with op.batch_alter_table("idempotency_records") as batch:
        batch.alter_column("target_hash", existing_type=sa.LargeBinary(32), nullable=False)
        batch.drop_constraint("uq_idempotency_records_key", type_="unique")
        batch.create_unique_constraint(
            "uq_idempotency_records_key", ["api_key_id", "target_hash", "key"]
        )


def downgrade() -> None:
    op.execute(records.delete().where(records.c.target_hash != CREATE_PET))
    with op.batch_alter_table("idempotency_records") as batch:
        batch.drop_constraint("uq_idempotency_records_key", type_="unique")
        batch.create_unique_constraint("uq_idempotency_records_key", ["api_key_id", "key"])
        batch.drop_column("target_hash")
