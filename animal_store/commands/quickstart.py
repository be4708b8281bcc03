"""`flask quickstart`: the database, a key and the development server in one command, and what it
says when its port is taken.

A taken port is asked, not assumed: the program on it is sent GET /v1/pets with the key just made.
Only a server reading this database knows a key made a moment ago (256 random bits), so a list of
animals in answer means the key works there. Anything else (another program, an Animal Store on
another database) is named by what it answered, and the key, which went to it, is revoked: it is
of no use to anyone, and a key sent to a program we do not know is not kept.
"""

import errno
import http.client
import json
import os
import socket
from datetime import UTC, datetime
from itertools import chain, count
from typing import cast

import click
from flask import Flask, current_app
from flask.cli import with_appcontext
from flask_migrate import upgrade
from werkzeug.local import LocalProxy
from werkzeug.serving import run_simple

from animal_store.access.auth import issue_key
from animal_store.data.database import uses_database
from animal_store.data.models import ApiKey
from animal_store.extensions import db

# The cheapest authenticated read: at most one animal.
PROBE_PATH = "/v1/pets?limit=1"
# A development server answers within this on a busy machine; a program that takes connections
# and never answers costs the user this long.
PROBE_SECONDS = 5
# More than any answer of an Animal Store to PROBE_PATH; the rest of a longer one is not read.
PROBE_BYTES = 65536
# Where to ask a server listening on every address.
LOOPBACK = {"0.0.0.0": "127.0.0.1", "::": "::1"}


@click.command("quickstart")
@with_appcontext
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=5000, show_default=True)
@uses_database(schema=False)
def quickstart(host: str, port: int) -> None:
    """Create or upgrade the database, make an API key, and run the development server."""
    upgrade()
    taken = port_taken(host, port)
    name = new_key_name()
    api_key, key = issue_key(name)
    db.session.commit()
    if taken:
        answer = unaccepted_answer(LOOPBACK.get(host, host), port, key)
        if answer is not None:
            api_key.revoked_at = datetime.now(UTC)
            db.session.commit()
            raise click.ClickException(
                f"{address(host, port)} is held by another program, not an Animal Store on this "
                f"database: to GET /v1/pets with the new key, {answer}. The key {name!r} is "
                "revoked: it went to that program. Run quickstart again with --port and a port "
                "nothing listens on."
            )
    url = f"http://{address(host, port)}/v1/pets"
    click.echo(f"API key {name!r} (shown only now): {key}")
    click.echo("Try, from another terminal:")
    click.echo(
        f"  curl -i -H 'Authorization: Bearer {key}' -H 'Content-Type: application/json' "
        f"""-d '{{"name": "Rex", "categoryId": 1, "status": "available"}}' {url}"""
    )
    click.echo(f"  curl -H 'Authorization: Bearer {key}' {url}")
    if taken:
        # Run again for another key while the first quickstart's server runs.
        click.echo(
            f"An Animal Store on this database already serves {address(host, port)} and "
            "accepted the new key: no second server is started."
        )
        return
    app = cast("LocalProxy[Flask]", current_app)._get_current_object()
    # Threaded: each request runs in its own thread with its own app context.
    run_simple(host, port, app, threaded=True)


def new_key_name() -> str:
    """Name the key for the second it is made; another made in the same second (a quickstart run
    again at once, from a script) gets -2, -3, ..."""
    stem = "quickstart-" + datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    taken = set(db.session.scalars(db.select(ApiKey.name).where(ApiKey.name.startswith(stem))))
    names = chain([stem], (f"{stem}-{number}" for number in count(2)))
    return next(name for name in names if name not in taken)


def port_taken(host: str, port: int) -> bool:
    """Say whether another program listens on the port; refuse an address that cannot be
    served on for any other reason (not this machine's, a port below 1024 without root)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.create_server((host, port), family=family):
            return False
    except OSError as error:
        if error.errno == errno.EADDRINUSE:
            return True
        # Said as the system says it: socket.create_server adds the address in its own words.
        reason = os.strerror(error.errno) if error.errno else str(error)
        raise click.ClickException(f"Cannot serve on {address(host, port)}: {reason}.") from None


def unaccepted_answer(host: str, port: int, key: str) -> str | None:
    """Ask the program on the port for PROBE_PATH with `key`: None if it answers with a list of
    animals, else what it answered, in words."""
    connection = http.client.HTTPConnection(host, port, timeout=PROBE_SECONDS)
    try:
        connection.request("GET", PROBE_PATH, headers={"Authorization": f"Bearer {key}"})
        response = connection.getresponse()
        body = response.read(PROBE_BYTES)
    except TimeoutError:
        return f"it did not answer within {PROBE_SECONDS} seconds"
    except http.client.RemoteDisconnected:
        return "it closed the connection without an answer"
    except http.client.BadStatusLine as error:
        return f"it does not speak HTTP: it answered {str(error.args[0]).strip()[:100]!r}"
    except http.client.HTTPException as error:
        return f"it does not speak HTTP: {error!r}"
    except OSError as error:
        return f"it could not be reached: {error.strerror or error}"
    finally:
        connection.close()
    said = f"it answered {response.status} {response.reason}"
    try:
        document = json.loads(body)
    except ValueError:
        document = None
    if response.status == 200:
        return None if isinstance(document, list) else f"{said}, but not with a list of animals"
    if isinstance(document, dict) and isinstance(document.get("message"), str):
        # An error object ({code, message, status}): an Animal Store, or one like it.
        return f'{said} ("{document["message"][:200]}")'
    return said


def address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
