"""The database a command works on: each command that reads or writes data first says which one
it is and where that choice came from, and refuses a database without the schema.

Without the deployment's environment the settings fall back to a development SQLite file in the
checkout; a command run from a shell that forgot the environment file would then write where the
service never reads, so the line on stderr says so before anything is done.
"""

import functools
import sys
from collections.abc import Callable
from pathlib import Path
from typing import ParamSpec, TypeVar

import click
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from flask import current_app
from sqlalchemy.exc import DBAPIError

from animal_store.extensions import db

Params = ParamSpec("Params")
Result = TypeVar("Result")


def upgrade_command() -> str:
    """Return the command that upgrades the schema, with the flask this process runs as
    (.venv/bin/flask on a deployed machine), so it can be typed as printed."""
    program = sys.argv[0] if Path(sys.argv[0]).name == "flask" else "flask"
    return f"{program} --app animal_store db upgrade"


def describe_database() -> str:
    """Return the database's URL, its password masked, and where the setting came from."""
    source = current_app.extensions["animal_store_database_source"]
    return f"{db.engine.url.render_as_string(hide_password=True)} ({source})"


def current_revision() -> str | None:
    """Return the migration the database is at, None where it has no schema."""
    with db.engine.connect() as connection:
        return MigrationContext.configure(connection).get_current_revision()


def head_revision() -> str | None:
    """Return the newest migration this code has (None for code without any)."""
    return ScriptDirectory(current_app.extensions["migrate"].directory).get_current_head()


def require_schema() -> None:
    """Refuse, with what to run, a database that is missing or lacks this code's schema."""
    url = db.engine.url
    if url.get_backend_name() == "sqlite" and not Path(url.database or "").is_file():
        # Opening it would create an empty file, where the next command would look again.
        raise click.ClickException(
            f"No database file {url.database}: run `{upgrade_command()}` first."
        )
    try:
        current = current_revision()
    except DBAPIError as error:
        reason = str(error.orig).strip().splitlines()[0]
        raise click.ClickException(f"Cannot use the database: {reason}") from None
    if current is None:
        raise click.ClickException(f"The database has no schema: run `{upgrade_command()}` first.")
    migrations = ScriptDirectory(current_app.extensions["migrate"].directory)
    head = migrations.get_current_head()
    if current == head:
        return
    if current not in {script.revision for script in migrations.walk_revisions()}:
        raise click.ClickException(
            f"The database's schema is at migration {current}, which this code does not have: "
            "newer code migrated it. Run that code's commands."
        )
    raise click.ClickException(
        f"The database's schema is at migration {current}, this code's at {head}: "
        f"run `{upgrade_command()}` first."
    )


def uses_database(
    schema: bool = True,
) -> Callable[[Callable[Params, Result]], Callable[Params, Result]]:
    """Make a command say which database it uses, on stderr, and with `schema`, refuse one
    without this code's schema before it runs."""

    def decorate(command: Callable[Params, Result]) -> Callable[Params, Result]:
        @functools.wraps(command)
        def run(*args: Params.args, **kwargs: Params.kwargs) -> Result:
            click.echo(f"Database: {describe_database()}", err=True)
            if schema:
                require_schema()
            return command(*args, **kwargs)

        return run

    return decorate
