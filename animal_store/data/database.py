"""The database a command works on: each command that reads or writes data first says which one
it is and where that choice came from, and refuses a database without the schema, or one it
cannot use (a wrong password, a host that does not answer, a missing database), in one line. A
fault the database meets while the command runs (a full disk, a server that takes only reads or
went away) ends it in one line too: `uses_database` says it for the store's commands, `connect`
for Alembic's (`flask db ...`), both through `faults_in_one_line`.

Without the deployment's environment the settings fall back to a development SQLite file in the
checkout; a command run from a shell that forgot the environment file would then write where the
service never reads, so the line on stderr says so before anything is done.
"""

import functools
import logging
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import ParamSpec, TypeVar

import click
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from flask import Config, current_app, g
from sqlalchemy import Connection, create_engine
from sqlalchemy.exc import DBAPIError, SQLAlchemyError

from animal_store.data.database_faults import (
    first_line,
    is_database_outage,
    is_disk_full,
    is_login_refusal,
    is_read_only_refusal,
    login_refused,
)
from animal_store.extensions import db
from animal_store.settings import masked_url

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
    return f"{masked_url(db.engine.url)} ({source})"


def cannot_use(error: SQLAlchemyError) -> click.ClickException:
    """The one-line refusal of a database a command cannot use, in the driver's first line, which
    names the host, the user or the database, never the password: a full disk and a server that
    takes only reads are named as such, with what to do."""
    reason = first_line(getattr(error, "orig", None) or error)
    if is_disk_full(error):
        return click.ClickException(
            f"The database has no space left for writes: {reason}. Free space on its disk, then "
            "run the command again."
        )
    if is_read_only_refusal(error):
        return click.ClickException(
            f"The database takes only reads: {reason}. DATABASE_URL names a standby, or a "
            "database set read-only: give it the primary's."
        )
    return click.ClickException(f"Cannot use the database: {reason}")


@contextmanager
def faults_in_one_line() -> Iterator[None]:
    """Say a fault of the database met in the block (a full disk, a server that takes only reads,
    went away or refuses the login: database_faults.is_database_outage) in one line, as the
    refusal of a database a command cannot use; an error that is a bug keeps its traceback."""
    try:
        yield
    except SQLAlchemyError as error:
        if not is_database_outage(error):
            raise
        raise cannot_use(error) from None


@contextmanager
def connect() -> Iterator[Connection]:
    """Connect to the app's database, or refuse it in one line, and say a fault met while the
    connection is used in one line too (`flask db ...`, through migrations/env.py), rather than
    with the driver's traceback."""
    with faults_in_one_line():
        try:
            connection = db.engine.connect()
        except DBAPIError as error:
            raise cannot_use(error) from None
        with connection:
            yield connection


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
        raise cannot_use(error) from None
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
    """Make a command say which database it uses, on stderr, and refuse one it cannot use before
    it runs: with `schema`, one without this code's schema; without, one it cannot connect to.
    A fault the database meets while the command runs ends it in one line too."""

    def decorate(command: Callable[Params, Result]) -> Callable[Params, Result]:
        @functools.wraps(command)
        def run(*args: Params.args, **kwargs: Params.kwargs) -> Result:
            click.echo(f"Database: {describe_database()}", err=True)
            # Said once: a command that migrates in process (quickstart) would say it again.
            g.database_said = True
            if schema:
                require_schema()
            elif db.engine.url.get_backend_name() != "sqlite":
                # (Opening a SQLite file creates it: these commands create or replace it anyway.)
                with connect():
                    pass
            with faults_in_one_line():
                return command(*args, **kwargs)

        return run

    return decorate


def check_login(config: Config) -> tuple[int, str] | None:
    """Connect once as the workers will (gunicorn's master, before any starts) and return what to
    log at which level: a refused login at ERROR, which stops the boot, as a bad setting does;
    a database that does not answer at WARNING, which does not: the service rides an outage out
    and serves once the database is back. None when it answers, and on SQLite (a file, which
    opening would create)."""
    url = config["SQLALCHEMY_DATABASE_URI"]
    if url.startswith("sqlite"):
        return None
    engine = create_engine(url, **config["SQLALCHEMY_ENGINE_OPTIONS"])
    try:
        engine.connect().close()
    except DBAPIError as error:
        cause = error.orig or error
        if is_login_refusal(error):
            refused = login_refused(engine.url, cause)
            return logging.ERROR, f"{refused} ({masked_url(engine.url)}); not starting."
        return logging.WARNING, (
            f"The database does not answer ({masked_url(engine.url)}): {first_line(cause)}. "
            "Starting anyway: requests are answered 503 until it does."
        )
    finally:
        engine.dispose()
    return None
