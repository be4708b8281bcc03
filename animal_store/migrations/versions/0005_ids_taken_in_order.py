"""Ids taken in order without serializing writers: the keyset trigger and order_xid (keyset.py).

Revision ID: 0005
Revises: 0004

On PostgreSQL the pets' identity becomes a plain sequence that goes on where the identity would
have, and a trigger takes the ids; existing rows get order_xid 0, settled. On SQLite the column
is added and nothing else changes: its single writer already orders ids. Both directions work on
a populated table, without rewriting it (a column with a constant default is only recorded).
Its functions are kept as it made them (keyset_0005.py), and so are the statements it ran for
the table (keyset_0006.py): 0006 and 0008 replace them.
"""

import sqlalchemy as sa
from alembic import op

from animal_store.migrations import keyset_0005, keyset_0006

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("pets") as batch:
        batch.add_column(
            sa.Column(keyset_0006.ORDER_XID, sa.BigInteger(), nullable=False, server_default="0")
        )
    if op.get_bind().dialect.name == "postgresql":
        op.execute(keyset_0005.TAKE_ID_FUNCTION)
        op.execute(keyset_0005.PENDING_FROM_FUNCTION)
        for statement in keyset_0006.order_ids_sql("pets"):
            op.execute(statement)


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        for statement in keyset_0006.unorder_ids_sql("pets"):
            op.execute(statement)
        op.execute("DROP FUNCTION keyset_take_id()")
        op.execute("DROP FUNCTION keyset_pending_from(regclass)")
    with op.batch_alter_table("pets") as batch:
        batch.drop_column(keyset_0006.ORDER_XID)
