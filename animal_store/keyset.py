"""Ids that become visible in id order, for any table walked in keyset pages.

A walk's next page starts after the last id it saw, so it would skip for good a row whose id is
lower than one it has seen but which committed after it. On SQLite the single writer rules that
out: an id is taken under the write lock, which is held until the commit. On PostgreSQL ids come
from a sequence and transactions commit in any order, so a table walked in keyset pages takes
its ids through a trigger, and a page shows a row only once the row is settled:

- The trigger (`keyset_take_id`, BEFORE INSERT, for each row) takes the row's id from the table's
  id sequence and stamps the row with `order_xid`: the highest transaction id of every writer
  that took an id up to this one, its own included. Both happen under an advisory lock held for
  a few microseconds, not through the commit (LOCK_SPACE says how it is taken). The last stamp
  given out is kept in a second sequence, which transactions do not roll back. Before it takes
  its first id, a writer marks itself in flight: a shared advisory lock on its transaction id,
  held until it ends.
- A row is settled when its `order_xid` is below the xmin of the reading statement's snapshot:
  every transaction up to `order_xid` has then ended, and with them every writer that took a
  lower id. Such a writer either committed, and its row is visible, or rolled back, and its id
  is a gap for good. So the rows a page shows, up to the first one not yet settled, are final.
- That xmin is the whole server's: any transaction that writes, in any database, holds it back
  while it is open. So where a row is not settled by its stamp, the read asks
  `keyset_in_flight`: under the lock it reads the last id taken (every writer of an id up to it
  has its mark in place by then), then the oldest writer still marked (pg_locks). It reads the
  page again in a snapshot taken after that answer, and a row up to that last id whose stamp is
  below the oldest writer is settled too: a writer that took a lower id has a transaction id no
  higher than the row's stamp, so it had ended by then, or it would have been the oldest or
  older. A transaction that took no id holds nothing back; a writer that hangs with an id holds
  back the rows stamped after it until it ends (its statement timeout).

Writers no longer wait for each other's commits: they share WAL flushes (group commit), and
creations scale with writers (benchmarks/creations.py). The price falls on walks alone: a row
stays out of pages for about a commit's latency, while a lower id is still in flight.

Subtle points, each relied on:
- The writer's own transaction id is assigned (pg_current_xact_id assigns it) before it takes
  an id, so a writer that took a lower id has its transaction id covered by the stamps from then
  on; and the stamp is the maximum so far, not the writer's own id, so a transaction that wrote
  something else first (and so has an older id), or adds many rows, is covered too.
- The id sequence must not cache values (CACHE 1, PostgreSQL's default): cached ids would be
  handed out by each session in its own order, outside the lock.
- The lock is taken and released within one statement, and the rest is the transaction's, so
  PgBouncer's transaction pooling is fine.
- One mark a transaction, however many rows and keyset tables it adds to (a seed adds 10,000):
  the lock table's room (max_locks_per_transaction) is not at stake. The mark is taken outside
  the lock, which guards only the id and the stamp. Marks are advisory locks on one-bigint
  keys, shared by every keyset table and by anything else in the database that takes such
  locks: another's mark only makes a read wait for more, and a foreign exclusive lock on a key
  would make a writer wait for it, so the database is best not shared with code that takes
  advisory locks on one-bigint keys.
- Stamps are transaction ids of the cluster that wrote them. After a logical restore
  (pg_restore) into another cluster they are meaningless, and far above its transaction ids:
  walks stay exact, but a row is shown only once no writer is in flight. `forget_order` settles
  every row again, and the restore command runs it.
- Version 1 of these functions (migration 0005) marked the first id a writer took, which took a
  transaction-local setting to know; marking the writer instead cut the trigger's cost by a
  fifth (docs/benchmarks.rst, Creations).
"""

from typing import Any, NotRequired, TypedDict, TypeVar

import sqlalchemy as sa
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.expression import ColumnElement, FunctionElement

# The column every keyset table has, beside its `id`: 0 where the engine orders ids itself.
ORDER_XID = "order_xid"
INT64_MAX = 2**63 - 1

# The lock around taking an id and its stamp: advisory, on two int4 keys (a space apart from the
# one-bigint keys that mark writers in flight), this constant and the id sequence's oid.
LOCK_SPACE = 0x6B657973  # "keys"

# Both functions take that lock by trying, not waiting: PostgreSQL hands a released lock to the
# first waiter even while that process sleeps, so with more writers than cores every writer would
# wait on the scheduler. It is a session's lock, taken and released within one call, and an
# exception handler releases it on any error (a session's lock outlives the transaction).
# LOCK opens the guarded block (after its BEGIN), UNLOCK closes it.
LOCK = f"""        LOOP
            locked := pg_try_advisory_lock({LOCK_SPACE}, ids::oid::int);
            EXIT WHEN locked;
            PERFORM pg_sleep(0.001);
        END LOOP;"""
UNLOCK = f"""    EXCEPTION WHEN OTHERS OR query_canceled THEN
        IF locked THEN
            PERFORM pg_advisory_unlock({LOCK_SPACE}, ids::oid::int);
        END IF;
        RAISE;
    END;
    PERFORM pg_advisory_unlock({LOCK_SPACE}, ids::oid::int);"""
TAKE_ID_FUNCTION = f"""
CREATE OR REPLACE FUNCTION keyset_take_id() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    ids regclass := TG_ARGV[0];
    stamps regclass := TG_ARGV[1];
    own bigint := pg_current_xact_id()::text::bigint;
    locked boolean := false;
    last_stamp bigint;
    taken bigint;
    stamp bigint;
BEGIN
    -- The writer's mark, until it ends, for keyset_in_flight: its transaction id, taken before
    -- its first id. A further row takes it again, which only counts up in the backend's own
    -- lock table: a seed of 10,000 rows holds one lock.
    PERFORM pg_advisory_xact_lock_shared(own);
    BEGIN
{LOCK}
        taken := nextval(ids);
        last_stamp := coalesce(pg_sequence_last_value(stamps), 0);
        stamp := greatest(own, last_stamp);
        IF stamp > last_stamp THEN
            PERFORM setval(stamps, stamp);
        END IF;
{UNLOCK}
    NEW.id := taken;
    NEW.{ORDER_XID} := stamp;
    RETURN NEW;
END $$
"""

IN_FLIGHT_FUNCTION = f"""
CREATE OR REPLACE FUNCTION keyset_in_flight(ids regclass, OUT last_id bigint, OUT oldest bigint)
LANGUAGE plpgsql AS $$
DECLARE
    locked boolean := false;
BEGIN
    BEGIN
{LOCK}
        -- Under the lock, every writer of an id up to last_id has its mark in place.
        last_id := coalesce(pg_sequence_last_value(ids), 0);
{UNLOCK}
    SELECT min((classid::bigint << 32) | objid::bigint) INTO oldest
    FROM pg_locks
    WHERE locktype = 'advisory' AND objsubid = 1 AND mode = 'ShareLock'
        AND database = (SELECT oid FROM pg_database WHERE datname = current_database());
END $$
"""  # noqa: S608 - constants only


# The last id taken and the oldest writer still in flight: see read_page in store.py.
IN_FLIGHT = sa.text("SELECT last_id, oldest FROM keyset_in_flight(CAST(:ids AS regclass))")


def sequences(table: str) -> tuple[str, str]:
    """The table's id sequence and the sequence of its last stamp."""
    return f"{table}_id_seq", f"{table}_{ORDER_XID}_seq"


def order_ids(connection: sa.Connection, table: str) -> None:
    """Make a table's ids taken in order, in the connection's transaction: what the migration
    that creates a table walked in keyset pages calls, as `order_ids(op.get_bind(), "table")`.

    On PostgreSQL it runs order_ids_sql (the table needs its `order_xid` column, and the
    functions migrations 0005 and 0006 made); on SQLite there is nothing to do. Dropping the
    table drops its trigger and sequences with it.
    """
    if connection.dialect.name == "postgresql":
        for statement in order_ids_sql(table):
            connection.execute(sa.text(statement))


def order_ids_sql(table: str) -> list[str]:
    """The statements that make a table's ids taken in order (PostgreSQL; after TAKE_ID_FUNCTION).

    The id column keeps its values: its identity or serial default, if it has one, becomes a
    plain sequence that starts where the old one would have gone on (the trigger must be alone in
    taking ids). Migrations run these: they must keep doing what they do.
    """
    ids, stamps = sequences(table)
    # The table name is the code's own, never a request's (here and below).
    return [
        f"""DO $$
        DECLARE
            next_id bigint;
            serial text;
        BEGIN
            SELECT greatest(
                coalesce(pg_sequence_last_value(pg_get_serial_sequence('{table}', 'id')), 0),
                coalesce(max(id), 0)
            ) + 1 INTO next_id FROM {table};
            ALTER TABLE {table} ALTER id DROP IDENTITY IF EXISTS;
            -- A serial column (a table created without an identity): its default and sequence.
            serial := pg_get_serial_sequence('{table}', 'id');
            ALTER TABLE {table} ALTER id DROP DEFAULT;
            IF serial IS NOT NULL THEN
                EXECUTE format('DROP SEQUENCE %s', serial);
            END IF;
            CREATE SEQUENCE {ids} CACHE 1 OWNED BY {table}.id;
            PERFORM setval('{ids}', next_id, false);
        END $$""",  # noqa: S608
        f"CREATE SEQUENCE {stamps} CACHE 1 OWNED BY {table}.{ORDER_XID}",
        f"CREATE TRIGGER {table}_take_id BEFORE INSERT ON {table} FOR EACH ROW "
        f"EXECUTE FUNCTION keyset_take_id('{ids}', '{stamps}')",
    ]


def unorder_ids_sql(table: str) -> list[str]:
    """The reverse of order_ids_sql: an identity again, going on after the last id taken."""
    ids, stamps = sequences(table)
    return [
        f"DROP TRIGGER {table}_take_id ON {table}",
        f"DROP SEQUENCE {stamps}",
        f"""DO $$
        DECLARE next_id bigint;
        BEGIN
            SELECT greatest(coalesce(pg_sequence_last_value('{ids}'), 0), coalesce(max(id), 0))
                + 1 INTO next_id FROM {table};
            DROP SEQUENCE {ids};
            EXECUTE format(
                'ALTER TABLE {table} ALTER id ADD GENERATED BY DEFAULT AS IDENTITY (START %s)',
                next_id
            );
        END $$""",  # noqa: S608
    ]


def forget_order_sql(table: str) -> list[str]:
    """Settle every row of the table: for a database restored into another cluster."""
    _, stamps = sequences(table)
    return [
        f"UPDATE {table} SET {ORDER_XID} = 0 WHERE {ORDER_XID} <> 0",  # noqa: S608
        f"ALTER SEQUENCE {stamps} RESTART",
    ]


KEYSET_TABLES = sa.text(
    "SELECT tgrelid::regclass::text FROM pg_trigger "
    "WHERE tgfoid = to_regproc('keyset_take_id') ORDER BY 1"
)


def forget_order(connection: sa.Connection) -> list[str]:
    """Settle every row of every keyset table, in the connection's transaction; return the tables.

    After a logical restore into another cluster the stamps are another cluster's transaction
    ids. Walks stay exact regardless (where a stamp says "not settled", the read asks which
    writers are in flight), but every read near such rows would take that slower path and show
    them only while no writer is in flight, and so would every new row's, whose stamp is the
    highest so far.
    """
    tables = list(connection.scalars(KEYSET_TABLES))
    for table in tables:
        for statement in forget_order_sql(table):
            connection.execute(sa.text(statement))
    return tables


class SnapshotXmin(FunctionElement[int]):
    """The oldest transaction still open when the statement's snapshot was taken.

    On engines with a single writer every committed row is settled, so there it is a number no
    stamp reaches.
    """

    type = sa.BigInteger()
    inherit_cache = True


@compiles(SnapshotXmin)
def _snapshot_xmin_any(element: SnapshotXmin, compiler: SQLCompiler, **kw: Any) -> str:
    return str(INT64_MAX)


@compiles(SnapshotXmin, "postgresql")
def _snapshot_xmin_postgresql(element: SnapshotXmin, compiler: SQLCompiler, **kw: Any) -> str:
    return "pg_snapshot_xmin(pg_current_snapshot())::text::bigint"


# What keyset_in_flight answered, for a page's second read (store.read_page); by default no row
# is settled by them, and the first read is settled by its snapshot alone.
LAST_ID, OLDEST = "keyset_last_id", "keyset_oldest"


def settled(table: sa.Table) -> ColumnElement[bool]:
    """A column of a SELECT: whether the row may be shown in a page (see the module's docs).

    The snapshot's xmin is a scalar subquery, so it is computed once per statement.
    """
    stamp = table.c[ORDER_XID]
    return sa.or_(
        stamp < sa.select(SnapshotXmin()).scalar_subquery(),
        sa.and_(
            table.c.id <= sa.bindparam(LAST_ID, 0, type_=sa.BigInteger()),
            stamp < sa.bindparam(OLDEST, 0, type_=sa.BigInteger()),
        ),
    ).label("settled")


class Settled(TypedDict):
    """A row of a keyset page, as far as settled_prefix reads it."""

    settled: NotRequired[bool]


Row = TypeVar("Row", bound=Settled)


def settled_prefix(rows: list[Row]) -> list[Row]:
    """The rows, read in id order with their `settled` column, up to the first one not settled."""
    shown = []
    for row in rows:
        read: Settled = row  # the checker pops a key of a TypedDict, not of a type variable
        if not read.pop("settled"):
            break
        shown.append(row)
    return shown
