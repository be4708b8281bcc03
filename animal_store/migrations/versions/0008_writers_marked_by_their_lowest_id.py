"""Writers marked by the lowest id they can take: no lock around taking an id, and no stamps.

Revision ID: 0008
Revises: 0007

PostgreSQL: the pets' trigger runs a function of its own, pets_take_id (version 3, keyset.py),
instead of keyset_take_id, and keyset_settled_to replaces keyset_in_flight. The stamps (the
`order_xid` column and its sequence) are dropped; ids and their sequence are unchanged. The
table is locked first, so writers of the old version have ended before the new one takes its
first id. The two versions read different marks: stop every app instance on the database while
this runs, and start them on the new code (docs/operations.rst, Database).

SQLite: the `order_xid` column is dropped; its single writer orders ids.

Downgrade: version 2 again (keyset_0006.py), with every row's stamp 0: settled, as it is.
"""

import sqlalchemy as sa
from alembic import op

from animal_store.data import keyset
from animal_store.migrations import keyset_0006

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    postgresql = op.get_bind().dialect.name == "postgresql"
    if postgresql:
        op.execute("LOCK TABLE pets IN ACCESS EXCLUSIVE MODE")
        op.execute("DROP TRIGGER pets_take_id ON pets")
        op.execute("DROP FUNCTION keyset_take_id()")
        op.execute("DROP FUNCTION keyset_in_flight(regclass)")
        op.execute(keyset.SETTLED_TO_FUNCTION)
        for statement in keyset.take_id_sql("pets"):
            op.execute(statement)
    # Its stamps' sequence, owned by the column, goes with it.
    with op.batch_alter_table("pets") as batch:
        batch.drop_column(keyset_0006.ORDER_XID)


def downgrade() -> None:
    postgresql = op.get_bind().dialect.name == "postgresql"
    if postgresql:
        op.execute("LOCK TABLE pets IN ACCESS EXCLUSIVE MODE")
        op.execute("DROP TRIGGER pets_take_id ON pets")
        op.execute("DROP FUNCTION pets_take_id()")
    with op.batch_alter_table("pets") as batch:
        batch.add_column(
            sa.Column(keyset_0006.ORDER_XID, sa.BigInteger(), nullable=False, server_default="0")
        )
    if postgresql:
        op.execute(keyset_0006.TAKE_ID_FUNCTION)
        op.execute(keyset_0006.IN_FLIGHT_FUNCTION)
        op.execute("DROP FUNCTION keyset_settled_to(regclass, bigint)")
        # The stamps' sequence and the trigger, as 0005 made them.
        for statement in keyset_0006.order_ids_sql("pets")[1:]:
            op.execute(statement)
