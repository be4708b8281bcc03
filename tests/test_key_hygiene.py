"""The key itself never appears in the logs, in any answer, or in the database: only its hash
is stored, and the tests search a gunicorn log and a dump of the database for it."""

import shutil
import sqlite3
import subprocess
from contextlib import closing

import requests
import sqlalchemy as sa
from sqlalchemy.engine import make_url

from animal_store.extensions import db


def database_dump(app, database_url) -> str:
    url = make_url(database_url)
    if url.drivername.startswith("sqlite"):
        # closing(): a sqlite3 connection's own `with` ends its transaction but leaves it open,
        # and only the garbage collector frees it (it is in a cycle with its statement cache),
        # whereupon Python 3.13 warns of it in whichever test comes next.
        with closing(sqlite3.connect(url.database)) as connection:
            return "\n".join(connection.iterdump())
    if shutil.which("pg_dump"):
        return subprocess.run(
            [
                "pg_dump",
                "--data-only",
                "--host",
                url.host or "127.0.0.1",
                "--port",
                str(url.port or 5432),
                "--username",
                url.username or "postgres",
                url.database,
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    with app.app_context():
        return "\n".join(
            repr(db.session.execute(sa.select(table)).all()) for table in db.metadata.sorted_tables
        )


def traces_of(key):
    # The whole key, and its secret part alone (what follows the ask_ prefix).
    return [key, key[len("ask_") :]]


def test_key_is_never_logged_answered_or_stored(
    app, make_key, runner, start_gunicorn, database_url
):
    key = make_key("holder")
    revoked = make_key("revoked")
    assert runner.invoke(args=["keys", "revoke", "revoked"]).exit_code == 0
    wrong = key[:-4] + "AAAA"
    server = start_gunicorn(workers=1)
    answers = []
    for headers in (
        {"Authorization": f"Bearer {key}"},
        {"Authorization": f"bearer {key}"},
        {"Authorization": f"Bearer {wrong}"},
        {"Authorization": f"Bearer {revoked}"},
        {"Authorization": f"Basic {key}"},
        {"Authorization": f"Bearer {key} extra"},
    ):
        for method, path, kwargs in (
            ("GET", "/v1/pets", {}),
            ("POST", "/v1/pets", {"json": {"name": "Rex", "categoryId": 1}}),
            ("POST", "/v1/pets", {"json": {"name": ""}}),
            (
                "POST",
                "/v1/pets",
                {"json": {"name": "Rex", "categoryId": 1}, "headers": {"Idempotency-Key": "k1"}},
            ),
            ("GET", "/v1/pets/1", {}),
            ("GET", "/v1/pets/nope", {}),
            ("DELETE", "/v1/pets", {}),
        ):
            extra = kwargs.pop("headers", {})
            response = requests.request(
                method, server.url + path, headers={**headers, **extra}, timeout=10, **kwargs
            )
            answers.append(str(response.headers) + response.text)
    listed = runner.invoke(args=["keys", "list"]).output
    server.stop()

    places = {
        "answers": "\n".join(answers),
        "gunicorn log": server.log(),
        "keys list": listed,
        "database dump": database_dump(app, database_url),
    }
    assert "holder" in places["database dump"]  # the dump did see the keys table
    for secret in (key, revoked, wrong):
        for trace in traces_of(secret):
            found = [place for place, text in places.items() if trace in text]
            assert not found, f"a key appears in: {found}"
