"""`flask seed COUNT`: sample animals in bulk, for benchmarks, demos and the docs."""

from typing import Any, cast

import click
import psycopg
import sqlalchemy as sa
from flask.cli import with_appcontext

from animal_store.data.database import uses_database
from animal_store.data.models import PET_STATUSES
from animal_store.data.store import PETS
from animal_store.extensions import db

# An animal's columns but its id: a status or None.
SampleRow = dict[str, str | int | None]

SAMPLE_NAMES = ("Rex", "Kitty", "Bubbles", "Polly", "Nibbles", "Shadow", "Goldie", "Biscuit")
# Every status of the enum, and animals without one, in equal shares.
SAMPLE_STATUSES = (*PET_STATUSES, None)
BATCH_SIZE = 10_000
COPY = "COPY pets (name, category_id, status) FROM STDIN"


def sample_pet(number: int) -> SampleRow:
    return {
        "name": f"{SAMPLE_NAMES[number % len(SAMPLE_NAMES)]} {number}",
        "category_id": number % 10 + 1,
        "status": SAMPLE_STATUSES[number % len(SAMPLE_STATUSES)],
    }


def seed_pets(count: int) -> None:
    """Insert COUNT sample animals in batches: COPY on PostgreSQL, executemany elsewhere."""
    for start in range(0, count, BATCH_SIZE):
        rows = [sample_pet(number) for number in range(start, min(start + BATCH_SIZE, count))]
        # The ids are the database's, taken in order as a creation's are (keyset.py), so
        # seeding while the service runs keeps its walks exact.
        connection = db.session.connection()
        if connection.dialect.name == "postgresql":
            copy_rows(connection, rows)
        else:
            connection.execute(PETS.insert(), rows)
        db.session.commit()


def copy_rows(connection: sa.Connection, rows: list[SampleRow]) -> None:
    # COPY is several times faster than even batched INSERTs for a million rows.
    driver_connection = cast("psycopg.Connection[Any]", connection.connection.driver_connection)
    try:
        with (
            driver_connection.cursor() as cursor,
            cursor.copy(COPY) as copy,
        ):
            for row in rows:
                copy.write_row((row["name"], row["category_id"], row["status"]))
    except psycopg.Error as error:
        # COPY goes past SQLAlchemy: its error is wrapped as SQLAlchemy wraps every statement's,
        # so that a fault of the database (a full disk, a standby) is told apart alike and said
        # in one line (data/database.py).
        raise sa.exc.DBAPIError.instance(COPY, None, error, psycopg.Error) from error


@click.command("seed")
@with_appcontext
@click.argument("count", type=click.IntRange(min=1))
@uses_database()
def seed_command(count: int) -> None:
    """Add COUNT sample animals, their statuses spread evenly over the enum and none."""
    seed_pets(count)
    click.echo(f"Seeded {count} animals.")
