"""How much a page deep in the list costs compared with the first: keyset pagination at scale.

Seeds COUNT animals (a million by default) and times listPets through the whole app (auth, query,
JSON, ETag) for the first page and the last page of the walk, with and without a status filter,
then the bare SQL of OFFSET against keyset for the same deep page. Prints medians.

    python benchmarks/keyset_pages.py                        # SQLite, a fresh file in /tmp
    python benchmarks/keyset_pages.py postgresql://postgres@127.0.0.1:5432/bench

A PostgreSQL database given here is migrated and its animals are deleted first: use a scratch one.
"""

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import sqlalchemy as sa
from flask_migrate import upgrade

from animal_store import create_app
from animal_store.access.auth import issue_key
from animal_store.commands.seed import seed_pets
from animal_store.data.filters import walk_of
from animal_store.data.models import Pet
from animal_store.data.pagination import Position, encode_cursor
from animal_store.extensions import db

LIMIT = 20


def median_ms(calls, runs):
    """Median milliseconds of each call; the calls take turns, so a load that comes and goes on
    the machine weighs on all of them alike."""
    for call in calls * min(10, runs):  # warm caches and the connection pool
        call()
    timings = [[] for _ in calls]
    for _ in range(runs):
        for call, times in zip(calls, timings, strict=True):
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
    return [statistics.median(times) * 1000 for times in timings]


def prepare(database_url, count):
    # A benchmark measures the store, not the rate limiter (which would stop it at 600 a minute).
    app = create_app({"DATABASE_URL": database_url, "RATELIMIT_ENABLED": False})
    with app.app_context():
        upgrade()
        db.session.execute(sa.delete(Pet))
        db.session.commit()
        start = time.perf_counter()
        seed_pets(count)
        print(f"seeded {count} animals in {time.perf_counter() - start:.1f} s")
        db.session.execute(sa.text("ANALYZE"))
        db.session.commit()
        _, key = issue_key(f"bench-{time.time_ns()}")
        db.session.commit()
    return app, {"Authorization": f"Bearer {key}"}


def last_page_cursor(status):
    """The cursor whose page is the last full one of the walk."""
    select = sa.select(Pet.id).order_by(Pet.id.desc()).offset(LIMIT).limit(1)
    if status:
        select = select.where(Pet.status == status)
    return encode_cursor(Position(db.session.scalar(select), walk_of({"status": status})))


def measure_pages(app, auth, runs):
    client = app.test_client()
    rows = []
    for status in (None, "sold"):
        base = f"/v1/pets?limit={LIMIT}" + (f"&status={status}" if status else "")
        with app.app_context():
            cursor = last_page_cursor(status)
        first_url, last_url = base, f"{base}&cursor={cursor}"
        assert len(client.get(last_url, headers=auth).get_json()) == LIMIT
        assert "Link" not in client.get(last_url, headers=auth).headers
        first, last = median_ms(
            [
                lambda url=first_url: client.get(url, headers=auth),
                lambda url=last_url: client.get(url, headers=auth),
            ],
            runs,
        )
        rows.append((status or "(none)", first, last))
    return rows


def measure_offset(app, count, runs):
    deep = count - LIMIT
    pets = Pet.__table__
    page = sa.select(pets).order_by(pets.c.id)
    with app.app_context(), db.engine.connect() as connection:
        last_id = connection.scalar(sa.select(pets.c.id).order_by(pets.c.id).offset(deep - 1))
        offset_sql = page.limit(LIMIT).offset(deep)
        keyset_sql = page.where(pets.c.id > last_id).limit(LIMIT + 1)
        offset, keyset = median_ms(
            [
                lambda: connection.execute(offset_sql).all(),
                lambda: connection.execute(keyset_sql).all(),
            ],
            max(5, runs // 20),
        )
    return deep, offset, keyset


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("database_url", nargs="?", help="PostgreSQL URL; default: SQLite in /tmp")
    parser.add_argument("--count", type=int, default=1_000_000)
    parser.add_argument("--runs", type=int, default=300, help="timed requests per page")
    arguments = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        url = arguments.database_url or f"sqlite:///{Path(scratch) / 'bench.sqlite3'}"
        app, auth = prepare(url, arguments.count)
        with app.app_context():
            print(f"engine: {db.engine.dialect.name}, {arguments.count} animals, limit {LIMIT}")
        print(f"{'status filter':<14} {'first page':>11} {'last page':>11} {'last/first':>11}")
        for status, first, last in measure_pages(app, auth, arguments.runs):
            print(f"{status:<14} {first:>8.3f} ms {last:>8.3f} ms {last / first:>10.2f}x")
        deep, offset, keyset = measure_offset(app, arguments.count, arguments.runs)
        print(
            f"SQL for the page at {deep}: OFFSET {offset:.3f} ms, keyset {keyset:.3f} ms "
            f"({offset / keyset:.0f}x)"
        )
        with app.app_context():
            db.engine.dispose()


if __name__ == "__main__":
    main()
