"""Writers marked in flight by their transaction id, not by their first id (keyset.py).

Revision ID: 0006
Revises: 0005

PostgreSQL only: keyset_take_id is replaced in place (every keyset table's trigger calls it by
name), and keyset_in_flight replaces keyset_pending_from. The two versions mark writers
differently (version 1 by the first id taken), so a reader of one version misreads the other's
marks: stop every app instance on the database while this runs, and start them on the new code
(docs/operations.rst, Database). Rows and stamps are unchanged, in both directions.
"""

from alembic import op

from animal_store.migrations import keyset_0005, keyset_0006

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(keyset_0006.TAKE_ID_FUNCTION)
        op.execute(keyset_0006.IN_FLIGHT_FUNCTION)
        op.execute("DROP FUNCTION keyset_pending_from(regclass)")


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(
            keyset_0005.TAKE_ID_FUNCTION.replace("CREATE FUNCTION", "CREATE OR REPLACE FUNCTION", 1)
        )
        op.execute(keyset_0005.PENDING_FROM_FUNCTION)
        op.execute("DROP FUNCTION keyset_in_flight(regclass)")
