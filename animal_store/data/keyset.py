"""Ids that become visible in id order, for any table walked in keyset pages.

A walk's next page starts after the last id it saw, so it would skip for good a row whose id is
lower than one it has seen but which committed after it. On SQLite the single writer rules that
out: an id is taken under the write lock, which is held until the commit. On PostgreSQL ids come
from a sequence and transactions commit in any order, so a table walked in keyset pages takes
its ids through a trigger, and a page shows a row only once it is settled: once every writer
that took a lower id has ended.

- The writer's mark. Before a transaction takes its first id from a table, the trigger
  (`<table>_take_id`, BEFORE INSERT, for each row) reads the last id the sequence gave out and
  takes a shared advisory lock whose key holds the next one: the lowest id this writer can get.
  It holds the lock until it ends. It takes no other lock, and waits for no other writer.
- What a reader asks (`keyset_settled_to`): first the last id taken, then the lowest mark in
  pg_locks. Every id up to both, the last id and the lowest mark's id minus one, is settled, and
  stays so. Proof: a writer that took such an id took it before the last id was read (a
  sequence hands out ids one at a time, in order), so it had its mark in place before the
  read of pg_locks, and its mark's id is at most its own. A mark that low was not among those
  read, so the writer had ended. It either committed, and its row is visible to a snapshot
  taken afterwards (a transaction becomes visible before it releases its locks), or it rolled
  back, and its id is a gap for good.
- What a page does (store.read_page). Its rows up to the answer are settled, in a snapshot
  taken after the answer: each app keeps the highest answer it was given per table, and a
  page's read shows the rows up to it. Where a row lies above, the page asks again and reads
  again, and shows the rows up to the first one still above. So a page of rows long settled
  costs one statement; a page at the end of a table that is growing, three.

Writers do not wait for each other: they share WAL flushes (group commit), and creations scale
with writers (docs/benchmarks.rst, Creations). The price falls on walks alone: a row stays out of
pages while a writer that may have taken a lower id is in flight, about a commit's latency.

Subtle points, each relied on:
- The id sequence must not cache values (CACHE 1, PostgreSQL's default): cached ids would be
  handed out by each session in its own order, and the last id read would not bound them.
- Two marks at most a transaction and table, however many rows it adds (a seed adds 10,000): a
  transaction-local setting, `keyset.<sequence>`, says the mark is taken, so the lock table's
  room (max_locks_per_transaction) is not at stake. Its later rows' ids are above its first.
  The mark and the setting belong to the same (sub)transaction: a savepoint rolled back
  releases the one and undoes the other, with the rows they were for, and the next row marks
  again.
- The mark is taken and the setting set within the transaction and nothing outlives it, so
  PgBouncer's transaction pooling is fine.
- The limit: a row added by a function that a cursor's query calls is marked under the cursor,
  not the transaction, and a later fetch of that cursor that fails inside a savepoint or an
  exception block releases the mark with the savepoint (PostgreSQL's AtSubAbort_Portals), while
  the row and the setting stay. Add rows to a keyset table that way and a walk may pass them;
  nothing in this service does (tests/test_keyset_order.py shows both cases, as expected
  failures). Only a function in C could take the mark for the transaction itself.
- Marks are advisory locks on one-bigint keys: the table's tag (MARK_TAG_BITS bits of a hash of
  its name) above 40 bits of id. Tags of two tables may collide, and other code in the database
  may take such locks: another's lock only makes a page stop sooner while it is held, and never
  shows a row too soon. A foreign exclusive lock on a mark's key would make a writer wait for
  it, so the database is best not shared with code that takes advisory locks on one-bigint
  keys. Ids beyond 2**40 (a trillion) are marked as 2**40 - 1: pages near them stop sooner, no
  more.
- Marks live in the primary's pg_locks, which no standby has (advisory locks are not
  replicated): a page on a standby takes its answer from the primary, with the position of the
  primary's WAL that holds every row up to it (SETTLED_AT), and reads on a standby that has
  replayed that far (store.page_on_standby has the argument).
- A reader with no mark of its own asks nothing of the writers: a transaction that writes
  elsewhere, in this database or another, holds nothing back.
- An app keeps its answers while it runs, and an answer holds while the sequence goes on from
  where it was: whatever moves it back (a restore of an older backup, TRUNCATE ... RESTART
  IDENTITY, setval) needs every instance stopped first, as restoring does
  (docs/operations.rst, Backups).
- Nothing in a row depends on the cluster it was written in: a restore into another cluster
  needs no step of its own.
- Version 2 of these functions (migration 0006) stamped each row with the highest transaction id
  of every writer up to it, under an advisory lock held while taking the id: a creation cost the
  server 338,000 instructions against 280,000 now (a plain INSERT: about 260,000), and 64
  writers got 0.72 of plain INSERTs' throughput against 0.87 now (docs/benchmarks.rst).
"""

import zlib
from typing import NamedTuple, NotRequired, TypedDict, TypeVar

import sqlalchemy as sa
from flask import current_app
from sqlalchemy.sql.expression import ColumnElement

INT64_MAX = 2**63 - 1
# A mark's key: the table's tag, then the writer's lowest possible id in MARK_ID_BITS bits.
MARK_ID_BITS = 40
MARK_TAG_BITS = 23  # so that a key stays a positive bigint
MARK_ID_MAX = (1 << MARK_ID_BITS) - 1

SETTLED_TO_FUNCTION = f"""
CREATE FUNCTION keyset_settled_to(ids regclass, marks bigint) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    -- First the last id taken: every writer of an id up to it has its mark in place by now.
    last_id bigint := pg_sequence_last_value(ids);
    lowest bigint;
BEGIN
    IF last_id IS NULL THEN
        -- No id taken since the sequence was set (a migration, TRUNCATE ... RESTART IDENTITY),
        -- which waited for every writer: every id below its value is settled.
        EXECUTE format('SELECT last_value - 1 FROM %s', ids) INTO last_id;
    END IF;
    SELECT min(((classid::bigint << 32) | objid::bigint) - marks) INTO lowest
    FROM pg_locks
    WHERE locktype = 'advisory' AND objsubid = 1
        AND classid::bigint >> {MARK_ID_BITS - 32} = marks >> {MARK_ID_BITS}
        AND database = (SELECT oid FROM pg_database WHERE datname = current_database());
    RETURN least(last_id, lowest - 1);
END $$
"""  # noqa: S608 - constants only

# A primary's timeline, as a number: the first 8 hex digits of its current WAL file's name
# (PostgreSQL has no function that returns it on a primary; pg_control_checkpoint()'s lags a
# promotion until the next checkpoint).
TIMELINE = "('x' || left(pg_walfile_name(pg_current_wal_insert_lsn()), 8))::bit(32)::int"
# What a page asks when a row lies above what its app knows is settled (store.read_page).
SETTLED_TO = sa.text("SELECT keyset_settled_to(CAST(:ids AS regclass), :marks)")
# The same question with where the primary's WAL stood once it was answered (standbys.py): a
# standby that has replayed that far holds every row up to the answer that was committed. The
# position is read after the answer: OFFSET 0 keeps the subquery a node of its own, whose row
# comes before the outer list is computed. A writer of such a row inserted its commit record
# before it released its mark, so below the position read afterwards. The insert position, not
# the write position: under synchronous_commit=off a commit returns, and releases its mark,
# before its record is written.
# The position is the primary's timeline with its place on it (Position).
SETTLED_AT = sa.text(
    f"SELECT settled, {TIMELINE}, (pg_current_wal_insert_lsn() - '0/0'::pg_lsn)::bigint FROM "  # noqa: S608 - constants
    "(SELECT keyset_settled_to(CAST(:ids AS regclass), :marks) AS settled OFFSET 0) AS asked"
)
# Where an app keeps its highest answer with its position, per table, for pages on standbys.
POSITIONS = "animal_store_keyset_positions"
# The bound value of settled(): up to which id the rows are settled.
SETTLED_TO_PARAMETER = "keyset_settled_to"
# Where an app keeps the highest answer it was given, per table.
ANSWERS = "animal_store_keyset"


def sequence(table: str) -> str:
    """The table's id sequence."""
    return f"{table}_id_seq"


def marks(table: str) -> int:
    """The base of the table's marks' keys: its tag, above the id's bits."""
    tag = zlib.crc32(table.encode()) & ((1 << MARK_TAG_BITS) - 1)
    return tag << MARK_ID_BITS


def order_ids(connection: sa.Connection, table: str) -> None:
    """Make a table's ids taken in order, in the connection's transaction: what the migration
    that creates a table walked in keyset pages calls, as `order_ids(op.get_bind(), "table")`.

    On PostgreSQL it runs order_ids_sql (the database needs keyset_settled_to, which migration
    0008 made); on SQLite there is nothing to do.
    """
    if connection.dialect.name == "postgresql":
        for statement in order_ids_sql(table):
            connection.execute(sa.text(statement))


def unorder_ids(connection: sa.Connection, table: str) -> None:
    """What the same migration's downgrade calls once it has dropped the table: dropping a table
    drops its trigger and sequence, not the trigger's function."""
    if connection.dialect.name == "postgresql":
        connection.execute(sa.text(f"DROP FUNCTION {table}_take_id()"))


def order_ids_sql(table: str) -> list[str]:
    """The statements that make a table's ids taken in order (PostgreSQL).

    The id column keeps its values: its identity or serial default, if it has one, becomes a
    plain sequence that starts where the old one would have gone on (the trigger must be alone in
    taking ids). Migrations run these: they must keep doing what they do (when they change, keep
    the old ones for the migrations that ran them, as migrations/keyset_0006.py does).
    """
    ids = sequence(table)
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
        *take_id_sql(table),
    ]


def take_id_sql(table: str) -> list[str]:
    """The table's trigger, and the function it runs (PostgreSQL).

    Each table has a function of its own, with its sequence and its marks' keys written in:
    PL/pgSQL plans them once per session, where read from a trigger's arguments they were looked
    up on every row, which cost about a tenth of the creations at 64 writers.
    """
    ids = sequence(table)
    marked = f"keyset.{ids}"
    return [
        f"""CREATE OR REPLACE FUNCTION {table}_take_id() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    first_write boolean := pg_current_xact_id_if_assigned() IS NULL;
BEGIN
    -- The writer's mark, until it ends: the lowest id it can take, before it takes one. Once
    -- a transaction, mostly: the setting that says the mark is taken costs as much as the rest
    -- of this function, so a transaction's first write (its first row here) marks without it,
    -- and its second row marks again and sets it. Two marks at most: the mark takes the
    -- transaction's id too, as its insert would next (in the same statement: one of its own
    -- cost four times as much), so a row never written (ON CONFLICT DO NOTHING) leaves no
    -- first write behind.
    IF first_write OR current_setting('{marked}', true) IS DISTINCT FROM 'yes' THEN
        PERFORM pg_advisory_xact_lock_shared(
            {marks(table)} + least(coalesce(pg_sequence_last_value('{ids}'), 0), {MARK_ID_MAX - 1})
            + 1
        ), pg_current_xact_id();
        IF NOT first_write THEN
            PERFORM set_config('{marked}', 'yes', true);
        END IF;
    END IF;
    NEW.id := nextval('{ids}');
    RETURN NEW;
END $$""",
        f"CREATE TRIGGER {table}_take_id BEFORE INSERT ON {table} FOR EACH ROW "
        f"EXECUTE FUNCTION {table}_take_id()",
    ]


def settled(table: sa.Table) -> ColumnElement[bool]:
    """A column of a SELECT: whether the row may be shown in a page (see the module's docs).

    Its value is bound: up to which id the rows are settled (known_settled_to, ask_settled_to).
    """
    bound = sa.bindparam(SETTLED_TO_PARAMETER, type_=sa.BigInteger(), required=True)
    return (table.c.id <= bound).label("settled")


def known_settled_to(connection: sa.Connection, table: sa.Table) -> int:
    """Up to which id every row of the table is settled, as far as this app has asked (0 before
    it has): on engines with a single writer, every id."""
    if connection.dialect.name != "postgresql":
        return INT64_MAX
    return known(table.name)


def ask_settled_to(connection: sa.Connection, table: sa.Table) -> int:
    """Ask the database up to which id every row of the table is settled; keep the answer for
    the app's later pages, and return it (or a higher one the app was given before)."""
    answer: int = connection.execute(
        SETTLED_TO, {"ids": sequence(table.name), "marks": marks(table.name)}
    ).scalar_one()
    return keep(table.name, answer)


def keep(table: str, answer: int) -> int:
    """Keep an answer for the app's later pages; return the highest it was given."""
    answers: dict[str, int] = current_app.extensions.setdefault(ANSWERS, {})
    # Two threads may store at once: a lower answer that wins only asks again sooner.
    highest = answers[table] = max(answer, known(table))
    return highest


def known(table: str) -> int:
    answers: dict[str, int] = current_app.extensions.get(ANSWERS, {})
    return answers.get(table, 0)


class Position(NamedTuple):
    """A position in the primary's WAL: its timeline, and the byte (LSN) on it. A standby holds
    what the primary wrote up to it only if it has replayed that far on the same timeline: after
    a failover, one that replayed the lost primary's last WAL, past where the new primary's
    timeline forked off, has positions of the same numbers and other contents."""

    timeline: int
    lsn: int


def known_position(table: sa.Table) -> tuple[int, Position | None]:
    """Up to which id every row of the table is settled, and from which position of the
    primary's WAL on a standby holds those rows, as far as this app has asked ((0, None)
    before)."""
    positions: dict[str, tuple[int, Position]] = current_app.extensions.get(POSITIONS, {})
    return positions.get(table.name, (0, None))


def ask_position(connection: sa.Connection, table: sa.Table) -> tuple[int, Position]:
    """Ask the primary up to which id every row of the table is settled and where its WAL
    stands; keep both for the app's later pages on standbys (the answer, for those on the
    primary too), and return them."""
    answer, timeline, lsn = connection.execute(
        SETTLED_AT, {"ids": sequence(table.name), "marks": marks(table.name)}
    ).one()
    position = Position(timeline, lsn)
    positions: dict[str, tuple[int, Position]] = current_app.extensions.setdefault(POSITIONS, {})
    # Kept as a pair: an answer with another answer's position could claim rows the position
    # does not hold. Two threads may store at once: a lower pair that wins only asks sooner.
    if answer >= positions.get(table.name, (0, None))[0]:
        positions[table.name] = (answer, position)
    keep(table.name, answer)
    return answer, position


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
