"""Migration 0006's functions and the statements 0005 ran per table, as they were: 0005 and 0006
run these, and 0008's downgrade puts them back. Frozen here, apart from keyset.py, whose functions
are the newest (a migration must go on doing what it did).

Version 2 of the ordering: a writer marks its transaction id in flight before it takes an id,
then takes the id and a stamp (the highest transaction id of every writer up to it) under an
advisory lock; a row is settled when its stamp is below the snapshot's xmin, or (keyset_in_flight)
below the oldest writer still marked. Version 3 (0008) marks each writer's lowest possible id
instead, and takes no lock.
"""

ORDER_XID = "order_xid"

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


def sequences(table: str) -> tuple[str, str]:
    """The table's id sequence and the sequence of its last stamp."""
    return f"{table}_id_seq", f"{table}_{ORDER_XID}_seq"


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
