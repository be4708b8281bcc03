"""What a request reads and writes: every statement the API layer and its views run, and how.

A view's writes run on a connection of its own in one transaction (db.engine.begin()), which
commits when the view's block ends and rolls back if it raises: the ORM's session and unit of work
cost a creation about 65 µs of CPU for nothing, as it writes no objects (issue 35). A read runs on
a pooled connection of its own (read()), outside the session too: no identity map and no objects,
which measured cheaper than the session (issue 7), and still read-your-writes, since a creation
commits before it answers. The key check's bookkeeping (a key's last use) is written by the
process's writer (last_used.py), off the request's path, in a transaction of its own, at most once
per KEY_LAST_USED_RESOLUTION: it may lag while the database stalls, and a crash loses what was not
written yet, but it never delays or fails a request and never mixes with what a view writes.
"""

import itertools
from collections.abc import Callable, Mapping
from datetime import datetime, timedelta
from typing import Any, NotRequired, TypedDict, TypeVar, cast

import sqlalchemy as sa
from flask import g
from sqlalchemy.exc import SQLAlchemyError

from animal_store.data import keyset, standbys
from animal_store.data.database_faults import is_database_outage
from animal_store.data.deadlines import DeadlinePassed, primary_share
from animal_store.data.failover import primary_answers, primary_down, primary_due, primary_fails
from animal_store.data.filters import LIST_FILTER_NAMES, LIST_FILTERS, Walk
from animal_store.data.models import ApiKey, Pet
from animal_store.data.without_primary import Unproven
from animal_store.extensions import db

# The mapped table, which the ORM types only as a FROM clause (a class may map a join).
PETS = cast("sa.Table", Pet.__table__)
# Built once at import, not per request: the reads select exactly the four columns the wire
# format has, with the values bound at execution. Ids are positive, so `id > 0` starts a walk.
# A page also reads whether each row is settled (keyset.py): it shows rows up to the first one
# that is not.
PET_ROW = sa.select(Pet.id, Pet.name, Pet.category_id, Pet.status)
LIST_PAGE = (
    PET_ROW.add_columns(keyset.settled(PETS))
    .where(Pet.id > sa.bindparam("after"))
    .order_by(Pet.id)
    .limit(sa.bindparam("limit"))
)
# One select per combination of the list's filters, keyed by which of them a walk gives, each
# bound under the filter's name.
LIST_PAGES = {
    given: LIST_PAGE.where(
        *(
            list_filter.column == sa.bindparam(list_filter.name)
            for list_filter, on in zip(LIST_FILTERS, given, strict=True)
            if on
        )
    )
    for given in itertools.product((False, True), repeat=len(LIST_FILTERS))
}
PET_BY_ID = PET_ROW.where(Pet.id == sa.bindparam("pet_id"))
# A key is found by its own hash or, for the grace of a rotation, by the one it replaced.
KEY_BY_HASH = sa.select(
    ApiKey.id,
    ApiKey.name,
    ApiKey.rate_limit,
    ApiKey.scopes,
    ApiKey.last_used_at,
    ApiKey.expires_at,
    (ApiKey.key_hash == sa.bindparam("key_hash")).label("current"),
    ApiKey.previous_key_expires_at,
).where(
    sa.or_(
        ApiKey.key_hash == sa.bindparam("key_hash"),
        ApiKey.previous_key_hash == sa.bindparam("key_hash"),
    ),
    ApiKey.revoked_at.is_(None),
)
# On the table, not the mapped class: an ORM-enabled insert would take the ORM's bulk path, which
# cost about 350 of the 1,400 µs of CPU a creation took (measured in process, issue 7).
# The id is the database's: on PostgreSQL a trigger takes it in order (keyset.py).
INSERT_PET = sa.insert(PETS).returning(PETS.c.id)

Rows = TypeVar("Rows")


class NewPet(TypedDict):
    """An animal as a client sends it (NewPetSchema loads it): the store gives it its id."""

    name: str
    category_id: int
    status: NotRequired[str]


class PetRow(TypedDict):
    """An animal as the store returns it: the four columns of the wire format."""

    id: int
    name: str
    category_id: int
    status: str | None


class PageRow(PetRow):
    # Whether the row may be shown yet; keyset.settled_prefix takes it out.
    settled: NotRequired[bool]


class KeyRow(TypedDict):
    """An unrevoked API key as the key check reads it."""

    id: int
    name: str
    rate_limit: str | None
    scopes: str
    last_used_at: datetime | None
    expires_at: datetime | None
    # True when found by its own hash; False for the key a rotation replaced, in its grace.
    current: bool
    previous_key_expires_at: datetime | None


def pets_after(after: int, limit: int, walk: Walk) -> list[PageRow]:
    """Return up to `limit` animals with ids above `after`, in id order, those the walk's filters
    keep, each with whether it is settled (keyset.settled_prefix)."""
    select = LIST_PAGES[tuple(value is not None for value in walk)]
    values = dict(zip(LIST_FILTER_NAMES, walk, strict=True))
    return read_page(select, {"after": after, "limit": limit, **values}, PETS)


def read_page(select: sa.Executable, values: Mapping[str, Any], table: sa.Table) -> list[PageRow]:
    """Run a keyset page's read, whose rows say whether they are settled (keyset.settled).

    The first read takes as settled the rows up to what the app last heard from the database
    (keyset.known_settled_to). Where a row lies above, the read asks the database again
    (keyset.ask_settled_to) and reads again, in a transaction, and so a snapshot, begun after the
    answer. With standbys (DATABASE_READ_URL), on one where it is safe (page_on_standby), which
    reads `values["limit"]`: the rows asked, one past the page.
    """
    reads = standbys.standbys()
    if reads is None:
        return read_page_on_primary(select, values, table, None)
    # Where the primary cannot answer, every row a standby that holds every acknowledged commit
    # shows is one to show (without_primary.py).
    everything = {**values, keyset.SETTLED_TO_PARAMETER: keyset.INT64_MAX}
    # While the primary is down, what asks it is the primary's page alone.
    down = primary_down()
    return without_primary(
        lambda: (
            read_page_on_primary(select, values, table, reads)
            if down
            else read_page_with_standbys(select, values, table, reads)
        ),
        lambda connection: cast("list[PageRow]", read_on(connection, select, everything)),
    )


def read_page_with_standbys(
    select: sa.Executable, values: Mapping[str, Any], table: sa.Table, reads: "standbys.Standbys"
) -> list[PageRow]:
    on_standby = reads.read(*page_on_standby(select, values, table))
    if on_standby is not None:
        return on_standby
    return read_page_on_primary(select, values, table, reads)


def read_page_on_primary(
    select: sa.Executable,
    values: Mapping[str, Any],
    table: sa.Table,
    reads: "standbys.Standbys | None",
) -> list[PageRow]:
    standbys.read_on_primary()
    with db.engine.connect() as connection:
        known = keyset.known_settled_to(connection, table)
        rows = as_dicts(connection.execute(select, {**values, keyset.SETTLED_TO_PARAMETER: known}))
        if all(row["settled"] for row in rows):
            return cast("list[PageRow]", rows)
        # With standbys, the answer with its position, for the app's next pages on them.
        if reads is None:
            answer = keyset.ask_settled_to(connection, table)
        else:
            answer = keyset.ask_position(connection, table)[0]
        if answer > known:
            # A transaction of its own: under REPEATABLE READ or SERIALIZABLE (a database's or
            # role's default) a read in the same one would reuse the snapshot from before.
            connection.commit()
            rows = as_dicts(
                connection.execute(select, {**values, keyset.SETTLED_TO_PARAMETER: answer})
            )
        return cast("list[PageRow]", rows)


def page_on_standby(
    select: sa.Executable, values: Mapping[str, Any], table: sa.Table
) -> tuple[keyset.Position | None, str, Callable[[sa.Connection], list[PageRow]]]:
    """The read of a keyset page on a standby, and the position it needs first (and the reason
    when the standby lacks it), for standbys.Standbys.read.

    The page shows what it would on the primary, from a snapshot that holds it. The app keeps
    its highest settled answer S with the primary's WAL position L read after it
    (keyset.SETTLED_AT): every row up to S that committed did so below L. On a standby that has
    replayed L, the page's rows up to S are those the primary's snapshot would show, so a full
    page of settled rows is exact, as on the primary: no row it passes is missing, none can come
    later below its last id (keyset.py). Its next page starts there. Where a row lies above S,
    or the page is the walk's last (fewer rows than asked: no next link), the primary is asked
    again for (S', L'), and the page is read again on a standby that has replayed L': L' was
    read after the walk began, so every creation acknowledged before then, the client's own
    included, lies below it, and the last page shows each one (those above S' are not settled,
    and cut the page short with a next link, as on the primary). A standby short of L' sends
    the page to the primary ("walk"). So a client's own creation, which has the highest id it
    knows of, is on a page with a row the app knew settled after it (which L covers) or on the
    last page: no floor per client is needed.
    """
    settled_to, position = keyset.known_position(table)

    def read_page_here(connection: sa.Connection) -> list[PageRow]:
        rows = as_dicts(
            connection.execute(select, {**values, keyset.SETTLED_TO_PARAMETER: settled_to})
        )
        if len(rows) >= values["limit"] and all(row["settled"] for row in rows):
            return cast("list[PageRow]", rows)
        answer, now_at = standbys.on_primary(lambda: ask_position(table))
        reads = cast("standbys.Standbys", standbys.standbys())
        reads.require(connection, now_at, "walk")
        rows = as_dicts(connection.execute(select, {**values, keyset.SETTLED_TO_PARAMETER: answer}))
        return cast("list[PageRow]", rows)

    return position, "walk", read_page_here


def ask_position(table: sa.Table) -> tuple[int, keyset.Position]:
    with db.engine.connect() as connection:
        return keyset.ask_position(connection, table)


def find_pet(pet_id: int) -> PetRow | None:
    """Return the animal with this id, or None: from a standby where it has it (an animal never
    changes), from the primary otherwise, and before None (never a standby's not found)."""
    values = {"pet_id": pet_id}
    reads = standbys.standbys()
    if reads is None:
        standbys.read_on_primary()
        rows = read(PET_BY_ID, values)
        return cast("PetRow", rows[0]) if rows else None
    if not primary_down():
        # Any position on the primary's timeline holds an animal it has (it never changes).
        found = reads.read(None, "walk", lambda connection: read_on(connection, PET_BY_ID, values))
        if found:
            return cast("PetRow", found[0])
        if found is not None:
            standbys.sent_back("not_found")
        standbys.read_on_primary()
    rows = without_primary(
        lambda: read(PET_BY_ID, values), lambda connection: read_on(connection, PET_BY_ID, values)
    )
    return cast("PetRow", rows[0]) if rows else None


def add_pet(connection: sa.Connection, pet: NewPet) -> int:
    """Insert an animal in the connection's transaction and return its new id."""
    pet_id: int = connection.execute(INSERT_PET, pet).scalar_one()
    return pet_id


def find_key(key_hash: bytes) -> KeyRow | None:
    """Return the unrevoked key with this hash, or that this hash was before a rotation, or None."""
    values = {"key_hash": key_hash}
    if standbys.standbys() is None:
        rows = read(KEY_BY_HASH, values)
    else:
        rows = without_primary(
            lambda: read(KEY_BY_HASH, values),
            lambda connection: read_on(connection, KEY_BY_HASH, values),
        )
        g.pop("database_read", None)  # (the metrics count the operation's read, not the key's)
    return cast("KeyRow", rows[0]) if rows else None


def without_primary(
    on_primary: Callable[[], Rows], on_standby: Callable[[sa.Connection], Rows]
) -> Rows:
    """Return what `on_primary` reads; where the primary cannot answer, what `on_standby` reads
    on a standby that holds every acknowledged commit (without_primary.py), or the primary's
    failure, which the API answers 503, where none can be shown to."""
    failure: SQLAlchemyError | None = None
    if primary_due():
        try:
            with primary_share():
                rows = on_primary()
        except SQLAlchemyError as error:
            if not is_database_outage(error):
                raise
            primary_fails()
            failure = error
        else:
            primary_answers()
            return rows
    hosts = cast("standbys.Standbys", standbys.standbys()).without_primary
    try:
        rows = hosts.read(on_standby)
    except Unproven as unproven:
        if unproven.reason == "promoted":
            # A standby is the primary now: asked through DATABASE_URL, with what is left of
            # the deadline (a host list may try a host that hangs first).
            rows = on_primary()
            primary_answers()
            return rows
        g.unproven = unproven.reason  # for the metrics
        if failure is not None:
            raise failure from None
        raise DeadlinePassed("The primary failed moments ago; no standby can answer") from None
    standbys.read_without_primary()
    return rows


def record_key_use(key_id: int, now: datetime, resolution: timedelta) -> None:
    """Set the key's last-used time, unless another worker set it within `resolution`.

    The UPDATE is conditional, so when several workers decide at once that the time is stale,
    only the first one's write changes the row.
    """
    stale = (ApiKey.last_used_at.is_(None)) | (ApiKey.last_used_at < now - resolution)
    with db.engine.connect() as connection:
        try:
            with connection.begin():
                connection.execute(
                    sa.update(ApiKey).where(ApiKey.id == key_id, stale).values(last_used_at=now)
                )
        finally:
            # Closed, not pooled: the writer (access/last_used.py) writes at most once a key a
            # resolution, and a connection it left in the pool would outlive an app that is gone
            # by then (a test's, its engine disposed while the write was on its way).
            connection.invalidate()


def read(select: sa.Executable, values: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Run a read on a pooled connection of its own and return its rows as plain dicts.

    marshmallow dumps dicts faster than row mappings, and zipping them from plain rows costs less
    than the mappings would.
    """
    with db.engine.connect() as connection:
        return as_dicts(connection.execute(select, values))


def read_on(
    connection: sa.Connection, select: sa.Executable, values: Mapping[str, Any]
) -> list[dict[str, Any]]:
    return as_dicts(connection.execute(select, values))


def as_dicts(result: sa.Result[Any]) -> list[dict[str, Any]]:
    columns = tuple(result.keys())
    # fetchall() takes the rows in one call; iterating would fetch them one at a time.
    return [dict(zip(columns, row, strict=True)) for row in result.fetchall()]
