"""Where a list request's time goes, in process: microseconds per piece, for profiling.

Seeds a SQLite file (or the scratch database given) and times, as medians of many calls, the
pieces of `GET /v1/pets?limit=20`: the key check, the page's select done several ways, the
marshmallow dump of ORM objects and of plain mappings, the JSON encoding, a bare Flask app
answering fixed bytes, and the whole request through the service's WSGI app. The pieces that are
alternatives (ORM against Core, session against engine connection) show what a change would gain.

    python benchmarks/list_pieces.py
    python benchmarks/list_pieces.py --profile     # pyinstrument over whole list requests

Needs the bench extra for --profile: pip install -e '.[bench]'.
"""

import argparse
import contextlib
import os
import statistics
import tempfile
import time
from pathlib import Path

import orjson
import sqlalchemy as sa
from flask import Flask
from flask_migrate import upgrade
from werkzeug.test import EnvironBuilder

from animal_store import create_app
from animal_store.access.auth import authenticate, hash_key, issue_key
from animal_store.commands.seed import seed_pets
from animal_store.data.models import ApiKey, Pet
from animal_store.extensions import db
from animal_store.pets import pets_schema

LIMIT = 20
PET_COLUMNS = (Pet.id, Pet.name, Pet.category_id, Pet.status)
PREBUILT_PAGE = sa.select(*PET_COLUMNS).order_by(Pet.id).limit(LIMIT + 1)


def median_us(call, runs, between=None) -> float:
    """Median microseconds of call(); between() runs untimed after each, to reset state."""
    for _ in range(min(50, runs)):
        call()
        if between:
            between()
    timings = []
    for _ in range(runs):
        start = time.perf_counter()
        call()
        timings.append(time.perf_counter() - start)
        if between:
            between()
    return statistics.median(timings) * 1e6


def wsgi_caller(app, path, headers):
    builder = EnvironBuilder(path=path, headers=headers, base_url="http://localhost")

    def call():
        body = b"".join(app(builder.get_environ(), lambda status, headers: None))
        assert body.startswith(b"["), body[:200]

    return call


def prepare(database_url, animals):
    # As the service runs in http_bench: no rate limit, and the request's JSON log line written
    # (main() sends it to /dev/null), since production writes one per request.
    app = create_app({"DATABASE_URL": database_url, "RATELIMIT_ENABLED": False})
    with app.app_context():
        upgrade()
        seed_pets(animals)
        _, key = issue_key(f"pieces-{time.time_ns()}")
        db.session.commit()
    return app, key


def measure(app, key, runs):
    auth = {"Authorization": f"Bearer {key}"}
    pieces = {}
    with app.test_request_context("/v1/pets?limit=20", headers=auth):
        reset = db.session.remove
        key_hash = hash_key(key)
        pieces["key lookup, ORM"] = median_us(
            lambda: db.session.scalar(
                sa.select(ApiKey).where(ApiKey.key_hash == key_hash, ApiKey.revoked_at.is_(None))
            ),
            runs,
            reset,
        )
        pieces["key check, as the service does it"] = median_us(authenticate, runs, reset)
        orm_page = sa.select(Pet).order_by(Pet.id).limit(LIMIT + 1)
        pieces["select, ORM objects"] = median_us(
            lambda: db.session.scalars(orm_page).all(), runs, reset
        )
        pieces["select, Core built per request"] = median_us(
            lambda: (
                db.session.execute(sa.select(*PET_COLUMNS).order_by(Pet.id).limit(LIMIT + 1))
                .mappings()
                .all()
            ),
            runs,
            reset,
        )
        pieces["select, Core prebuilt, session"] = median_us(
            lambda: db.session.execute(PREBUILT_PAGE).mappings().all(), runs, reset
        )

        def on_engine_connection():
            with db.engine.connect() as connection:
                return connection.execute(PREBUILT_PAGE).mappings().all()

        pieces["select, Core prebuilt, engine.connect"] = median_us(on_engine_connection, runs)
        objects = db.session.scalars(orm_page).all()[:LIMIT]
        mappings = on_engine_connection()[:LIMIT]
        pieces["dump, ORM objects"] = median_us(lambda: pets_schema.dump(objects), runs)
        pieces["dump, row mappings"] = median_us(lambda: pets_schema.dump(mappings), runs)
        dicts = [dict(row) for row in mappings]
        pieces["dump, dicts"] = median_us(lambda: pets_schema.dump(dicts), runs)
        dumped = pets_schema.dump(mappings)
        pieces["JSON, orjson"] = median_us(lambda: orjson.dumps(dumped), runs)
        reset()
    bare = Flask("bare")
    page = orjson.dumps(dumped)
    bare.add_url_rule("/v1/pets", "list_pets", lambda: (page, 200, {"Content-Type": "x"}))
    pieces["bare Flask, fixed bytes"] = median_us(wsgi_caller(bare, "/v1/pets", auth), runs)
    pieces["whole list request (service WSGI app)"] = median_us(
        wsgi_caller(app, "/v1/pets?limit=20", auth), runs
    )
    return pieces


def profile(app, key, runs):
    from pyinstrument import Profiler

    call = wsgi_caller(app, "/v1/pets?limit=20", {"Authorization": f"Bearer {key}"})
    for _ in range(50):
        call()
    profiler = Profiler(interval=0.0001)
    profiler.start()
    for _ in range(runs):
        call()
    profiler.stop()
    return profiler


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=2000, help="timed calls per piece (2000)")
    parser.add_argument("--animals", type=int, default=10_000, help="animals seeded (10,000)")
    parser.add_argument("--database-url", help="a scratch database instead of SQLite in /tmp")
    parser.add_argument("--profile", action="store_true", help="pyinstrument whole requests")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="animal-pieces-") as workdir:
        app, key = prepare(
            args.database_url or f"sqlite:///{Path(workdir) / 'pieces.sqlite3'}", args.animals
        )
        with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull):
            if args.profile:
                profiler = profile(app, key, args.runs)
            else:
                pieces = measure(app, key, args.runs)
        if args.profile:
            print(profiler.output_text(unicode=True, show_all=False))
            return
        for piece, micros in pieces.items():
            print(f"{micros:8.0f} µs  {piece}")


if __name__ == "__main__":
    main()
