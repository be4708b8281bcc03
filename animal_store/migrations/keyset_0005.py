"""Migration 0005's functions, as it created them: 0005 runs these, and 0006's downgrade puts
them back. Frozen here, apart from keyset.py, whose functions are the newest (a migration must go
on doing what it did).

Version 1 of the ordering: each writer marks the first id it takes (a shared advisory lock on the
id, and a transaction-local setting that says it has one), under the lock; keyset_pending_from
answers the first id still marked. Version 2 (0006) marks the writer's transaction id instead.
"""

TAKE_ID_FUNCTION = """
CREATE FUNCTION keyset_take_id() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    ids regclass := TG_ARGV[0];
    stamps regclass := TG_ARGV[1];
    own bigint := pg_current_xact_id()::text::bigint;
    first_id_setting text := 'keyset.first_id_' || ids::oid;
    locked boolean := false;
    taken bigint;
    stamp bigint;
BEGIN
    BEGIN
        LOOP
            locked := pg_try_advisory_lock(1801812339, ids::oid::int);
            EXIT WHEN locked;
            PERFORM pg_sleep(0.001);
        END LOOP;
        taken := nextval(ids);
        stamp := greatest(own, coalesce(pg_sequence_last_value(stamps), 0));
        PERFORM setval(stamps, stamp);
        -- The transaction's first id here is marked pending until it ends, for
        -- keyset_pending_from.
        IF coalesce(current_setting(first_id_setting, true), '') = '' THEN
            PERFORM pg_advisory_xact_lock_shared(taken);
            PERFORM set_config(first_id_setting, taken::text, true);
        END IF;
    EXCEPTION WHEN OTHERS OR query_canceled THEN
        IF locked THEN
            PERFORM pg_advisory_unlock(1801812339, ids::oid::int);
        END IF;
        RAISE;
    END;
    PERFORM pg_advisory_unlock(1801812339, ids::oid::int);
    NEW.id := taken;
    NEW.order_xid := stamp;
    RETURN NEW;
END $$
"""

PENDING_FROM_FUNCTION = """
CREATE FUNCTION keyset_pending_from(ids regclass) RETURNS bigint LANGUAGE plpgsql AS $$
DECLARE
    locked boolean := false;
    last_id bigint;
    pending bigint;
BEGIN
    BEGIN
        LOOP
            locked := pg_try_advisory_lock(1801812339, ids::oid::int);
            EXIT WHEN locked;
            PERFORM pg_sleep(0.001);
        END LOOP;
        -- Under the lock, every id up to last_id has its writer's mark in place.
        last_id := coalesce(pg_sequence_last_value(ids), 0);
    EXCEPTION WHEN OTHERS OR query_canceled THEN
        IF locked THEN
            PERFORM pg_advisory_unlock(1801812339, ids::oid::int);
        END IF;
        RAISE;
    END;
    PERFORM pg_advisory_unlock(1801812339, ids::oid::int);
    SELECT min((classid::bigint << 32) | objid::bigint) INTO pending
    FROM pg_locks
    WHERE locktype = 'advisory' AND objsubid = 1 AND mode = 'ShareLock'
        AND database = (SELECT oid FROM pg_database WHERE datname = current_database());
    RETURN least(pending, last_id + 1);
END $$
"""
