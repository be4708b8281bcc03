"""`flask backup FILE` and `flask restore FILE`: copies of the database, SQLite or PostgreSQL.

A backup runs while the service serves and writes. On SQLite the online backup API copies the
database in one step, inside one read transaction, so the copy is the database as it stood at one
moment, and in WAL mode the writers go on meanwhile. (A backup in several steps would start over
each time another connection writes, and under steady writes might never end.) On PostgreSQL
pg_dump copies one snapshot, the one this command counts the rows of, into a custom-format
archive, which `pg_restore --list` then reads back.

A restore is offline: it refuses while any process has the SQLite file open, or any other session
is connected to the PostgreSQL database.

The PostgreSQL password goes to pg_dump and pg_restore in a password file held in memory that
only they read, never on their command line (which `ps` shows anyone) nor in what is printed.
"""

import os
import re
import shutil
import sqlite3
import subprocess
from collections.abc import Iterator
from contextlib import closing, contextmanager
from pathlib import Path
from typing import Any

import click
import psycopg.conninfo
from flask import current_app
from flask.cli import with_appcontext
from sqlalchemy import Engine, Row, func, select, text

from animal_store.data.database import (
    current_revision,
    head_revision,
    upgrade_command,
    uses_database,
)
from animal_store.data.models import ApiKey, Pet
from animal_store.extensions import db, settings
from animal_store.settings import masked_url

# `pg_restore --list`: "215; 0 16390 TABLE DATA public pets store".
TABLE_DATA = re.compile(r"^\d+; \d+ \d+ TABLE DATA (\S+) (\S+) ", re.MULTILINE)
# The tables whose data a backup must hold to be this service's: its own and Alembic's.
BACKED_UP_TABLES = ("alembic_version", "pets", "api_keys")


def claim_new_file(path: Path) -> None:
    """Create PATH, empty and readable by its owner only, or refuse saying why; never replace a
    file, and never make a directory: a mistyped one would hide the backups."""
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except FileExistsError:
        raise click.ClickException(f"{path} exists already: give a new file.") from None
    except FileNotFoundError:
        raise click.ClickException(
            f"The directory {path.parent} does not exist: make it first "
            f"(install -d -m 700 {path.parent})."
        ) from None
    except NotADirectoryError:
        raise click.ClickException(f"{path.parent} is not a directory.") from None
    except OSError as error:
        raise click.ClickException(f"Cannot create {path}: {error.strerror}.") from None


def on_sqlite() -> bool:
    return db.engine.url.get_backend_name() == "sqlite"


@click.command("backup")
@with_appcontext
@click.argument("destination", type=click.Path(dir_okay=False, path_type=Path))
@uses_database()
def backup_command(destination: Path) -> None:
    """Copy the live database to DESTINATION, a new file, while the service serves."""
    if not on_sqlite():
        refuse_pgbouncer()
    claim_new_file(destination)
    try:
        summary = backup_sqlite(destination) if on_sqlite() else backup_postgres(destination)
    except BaseException:
        destination.unlink(missing_ok=True)  # ours: claimed above, and not a backup
        raise
    click.echo(summary)


@click.command("restore")
@with_appcontext
@click.argument("source", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@uses_database(schema=False)
def restore_command(source: Path) -> None:
    """Put the backup SOURCE in place of the database. Stop the service first."""
    summary = restore_sqlite(source) if on_sqlite() else restore_postgres(source)
    revision = current_revision()
    if revision == head_revision():
        click.echo(f"{summary} Start the service again.")
    else:
        click.echo(
            f"{summary} Its schema is at migration {revision}: run `{upgrade_command()}`, "
            "then start the service again."
        )


# SQLite


def sqlite_path() -> Path:
    database = db.engine.url.database
    if not database:  # sqlite:// is a database in memory, which no command can reach
        raise click.ClickException(
            "The database is in memory (sqlite://): it has no file to restore."
        )
    return Path(database).resolve()


def copy_database(source: Path, destination: Path) -> None:
    """Copy one SQLite database onto another with the online backup API, in one step."""
    try:
        with (
            closing(sqlite3.connect(source)) as reader,
            closing(sqlite3.connect(destination)) as writer,
        ):
            reader.backup(writer, pages=-1)
    except sqlite3.Error as error:  # a directory gone, a disk full: the operator's to mend
        raise click.ClickException(f"Copying {source} to {destination} failed: {error}") from None


def check_copy(path: Path) -> int:
    """Return the number of animals in a copy that passes SQLite's integrity check."""
    with closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as copy:
        try:
            verdict = copy.execute("PRAGMA integrity_check").fetchone()[0]
            count = (
                copy.execute("SELECT count(*) FROM pets").fetchone()[0] if verdict == "ok" else 0
            )
        except sqlite3.DatabaseError as error:
            raise click.ClickException(f"{path} is not an Animal Store database: {error}") from None
    if verdict != "ok":
        raise click.ClickException(f"{path} fails SQLite's integrity check: {verdict}")
    return count


def processes_holding(path: Path) -> list[int]:
    """The other processes that have the database file (or its WAL) open, from /proc."""
    names = {str(path), f"{path}-wal"}
    holders = []
    for fd_dir in Path("/proc").glob("[0-9]*/fd"):
        pid = int(fd_dir.parent.name)
        if pid == os.getpid():
            continue
        try:
            if any(os.readlink(fd) in names for fd in fd_dir.iterdir()):
                holders.append(pid)
        except OSError:
            continue  # gone, or not ours to look at
    return sorted(holders)


def backup_sqlite(destination: Path) -> str:
    source = sqlite_path()
    copy_database(source, destination)
    count = check_copy(destination)
    return f"Backed up {source} to {destination}: {count} animals, integrity check ok."


def restore_sqlite(source: Path) -> str:
    destination = sqlite_path()
    check_copy(source)
    db.engine.dispose()  # this command's own connections
    if holders := processes_holding(destination):
        raise click.ClickException(
            f"{destination} is open in processes {', '.join(map(str, holders))}: stop the "
            "service (every gunicorn instance on this file) before restoring."
        )
    copy_database(source, destination)
    count = check_copy(destination)
    return f"Restored {source} to {destination}: {count} animals."


# PostgreSQL


def refuse_pgbouncer() -> None:
    if settings(current_app).DATABASE_BEHIND_PGBOUNCER:
        # pg_dump and pg_restore set session settings (extra_float_digits, search_path, ...)
        # that transaction pooling would apply to whichever server connection came next.
        raise click.ClickException(
            "DATABASE_URL is PgBouncer (DATABASE_BEHIND_PGBOUNCER): pg_dump and pg_restore need "
            "a session of their own. Run the command with DATABASE_URL naming PostgreSQL itself "
            "and ANIMAL_STORE_DATABASE_BEHIND_PGBOUNCER=false."
        )


def connection_parameters() -> tuple[dict[str, str], str | None]:
    """Return libpq's parameters for the app's database, as the app's driver reads its URL,
    without the password, and the password apart."""
    _, parameters = db.engine.dialect.create_connect_args(db.engine.url)
    parameters = {
        name: str(value)
        for name, value in parameters.items()
        if name != "context"  # psycopg's adapters, not libpq's
    }
    parameters.setdefault("connect_timeout", str(settings(current_app).DATABASE_CONNECT_TIMEOUT))
    return parameters, parameters.pop("password", None)


@contextmanager
def password_file(password: str | None) -> Iterator[tuple[dict[str, str], tuple[int, ...]]]:
    """Yield the environment and the open file that give pg_dump or pg_restore the password: a
    libpq password file that lives in memory (memfd), read as /dev/fd/N. Nothing on disk to clean
    up if the command is killed, and nothing `ps e` shows, as PGPASSWORD would be."""
    # The tool reads its database from --dbname; the URL holding the password stays here.
    environment = {
        name: value
        for name, value in os.environ.items()
        if name not in ("DATABASE_URL", "ANIMAL_STORE_DATABASE_URL")
    }
    if password is None:
        yield environment, ()  # ~/.pgpass or PGPASSWORD, as the app itself would use
        return
    if "\n" in password:
        raise click.ClickException("The password holds a line break, which libpq cannot read.")
    entry = password.replace("\\", "\\\\").replace(":", "\\:")
    descriptor = os.memfd_create("pgpass")
    try:
        os.fchmod(descriptor, 0o600)  # libpq ignores a password file others may read
        os.write(descriptor, f"*:*:*:*:{entry}\n".encode())
        environment.pop("PGPASSWORD", None)  # it would win over the file
        environment["PGPASSFILE"] = f"/dev/fd/{descriptor}"
        yield environment, (descriptor,)
    finally:
        os.close(descriptor)


def run_tool(program: str, *arguments: str, connect: bool = True) -> str:
    """Run pg_dump or pg_restore, on the app's database when `connect`, and return what it
    printed; a failure is a ClickException with the tool's own message."""
    executable = shutil.which(program)
    if executable is None:
        raise click.ClickException(
            f"{program} is not installed (Debian: postgresql-client, of the server's version)."
        )
    command = [executable, *arguments]
    parameters, password = connection_parameters() if connect else ({}, None)
    if connect:
        # --no-password: fail at once rather than wait for a prompt that cron never answers.
        command[1:1] = ["--no-password", f"--dbname={psycopg.conninfo.make_conninfo(**parameters)}"]
    with password_file(password) as (environment, descriptors):
        result = subprocess.run(
            command, env=environment, pass_fds=descriptors, capture_output=True, text=True
        )
    if result.returncode != 0:
        raise click.ClickException(f"{program} failed: {result.stderr.strip()}")
    return result.stdout


def tables_with_data(archive: Path) -> tuple[set[str], int]:
    """Read a pg_dump archive's table of contents: the tables it holds data of, and its
    number of entries. Refuse a file that is not a custom-format archive of this service."""
    try:
        listing = run_tool("pg_restore", "--list", str(archive), connect=False)
    except click.ClickException as error:
        raise click.ClickException(
            f"{archive} is not a pg_dump archive (custom format): {error.message}"
        ) from None
    tables = {name for schema, name in TABLE_DATA.findall(listing)}
    if missing := sorted(set(BACKED_UP_TABLES) - tables):
        raise click.ClickException(
            f"{archive} is not an Animal Store backup: no data for {', '.join(missing)}."
        )
    entries = sum(1 for line in listing.splitlines() if line and not line.startswith(";"))
    return tables, entries


def backup_postgres(destination: Path) -> str:
    # pg_dump copies the snapshot this transaction exports, so the counts are the dump's.
    connection = db.engine.connect().execution_options(
        isolation_level="REPEATABLE READ", postgresql_readonly=True
    )
    with connection, connection.begin():
        snapshot = connection.scalar(text("SELECT pg_export_snapshot()"))
        animals = connection.scalar(select(func.count()).select_from(Pet))
        keys = connection.execute(select(func.count()).select_from(ApiKey)).scalar_one()
        revision = connection.scalar(text("SELECT version_num FROM alembic_version"))
        run_tool("pg_dump", "--format=custom", f"--snapshot={snapshot}", f"--file={destination}")
    tables, entries = tables_with_data(destination)
    return (
        f"Backed up {masked_url(db.engine.url)} to {destination} "
        f"({destination.stat().st_size} bytes): {animals} animals, {api_keys(keys)}, migration "
        f"{revision}; pg_restore --list reads {entries} entries, with the data of "
        f"{', '.join(sorted(tables))}."
    )


def api_keys(count: int) -> str:
    return "1 API key" if count == 1 else f"{count} API keys"


def sessions_connected() -> list[str]:
    """Describe the other sessions connected to the database, under any role: the service's,
    an operator's psql, a report's."""
    # PostgreSQL shows another role's session to a role that is not a superuser (nor in
    # pg_read_all_stats) with its database, pid, role and application name, but with no
    # backend_type and no client address; so backend_type cannot tell a session from a
    # background process. The role can: of the processes in a database, only autovacuum workers
    # have none (checkpointer, walwriter and the launchers are in no database). A parallel
    # worker or a logical replication worker has its session's role, and counts.
    with db.engine.connect() as connection:
        viewer = connection.scalar(text("SELECT current_user"))
        rows = connection.execute(
            text(
                "SELECT pid, usename, application_name, client_addr, client_port, backend_type "
                "FROM pg_stat_activity WHERE datname = current_database() "
                "AND pid <> pg_backend_pid() AND usesysid IS NOT NULL ORDER BY pid"
            )
        ).all()
    db.engine.dispose()  # this command's own connection is not one to wait for
    return [describe_session(row, viewer) for row in rows]


def describe_session(row: Row[Any], viewer: str) -> str:
    """Name a session of pg_stat_activity by pid, role, application and client, as far as
    `viewer` may see them."""
    application = (
        f"application {row.application_name}" if row.application_name else "no application name"
    )
    if row.client_addr is not None:
        origin = f"from {row.client_addr}"
    elif row.client_port == -1:
        origin = "from the local socket"
    elif row.backend_type is None:  # another role's session: see sessions_connected
        origin = f"its address not shown to role {viewer}"
    else:  # no client: a parallel or logical replication worker
        origin = f"a {row.backend_type}"
    return f"pid {row.pid} (role {row.usename}, {application}, {origin})"


def restore_postgres(source: Path) -> str:
    refuse_pgbouncer()
    _, entries = tables_with_data(source)
    if sessions := sessions_connected():
        raise click.ClickException(
            f"Other sessions are connected to the database: {', '.join(sessions)}. Stop the "
            "service (every gunicorn instance on it) and end these sessions before restoring."
        )
    # One transaction: a restore that fails anywhere leaves the database as it was. Objects
    # belong to the app's role, whoever owned them where the dump was made.
    run_tool(
        "pg_restore",
        "--clean",
        "--if-exists",
        "--single-transaction",
        "--no-owner",
        "--no-privileges",
        str(source),
    )
    after_postgres_restore(db.engine)
    with db.engine.connect() as connection:
        animals = connection.scalar(select(func.count()).select_from(Pet))
        keys = connection.execute(select(func.count()).select_from(ApiKey)).scalar_one()
    return (
        f"Restored {source} ({entries} entries) to {masked_url(db.engine.url)}: "
        f"{animals} animals, {api_keys(keys)}."
    )


def after_postgres_restore(engine: Engine) -> None:
    """Make a freshly restored PostgreSQL database ready for the service: the one place for
    whatever a restore needs beyond pg_restore, run once it has succeeded."""
    with engine.begin() as connection:
        # pg_restore leaves the planner without statistics until autovacuum comes round.
        connection.execute(text("ANALYZE"))
