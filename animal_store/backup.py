"""`flask backup DEST` and `flask restore SRC`: copies of the embedded SQLite database.

A backup runs while the service serves and writes: SQLite's online backup API copies the
database in one step, inside one read transaction, so the copy is the database as it stood at one
moment, and in WAL mode the writers go on meanwhile. (A backup in several steps would start over
each time another connection writes, and under steady writes might never end.) On PostgreSQL the
tool is pg_dump; the command says so and prints the line to run.

A restore is offline: it refuses while any process has the database file open.
"""

import os
import sqlite3
from contextlib import closing
from pathlib import Path

import click
from flask.cli import with_appcontext
from sqlalchemy.engine import make_url

from animal_store.extensions import db


def sqlite_path() -> Path:
    """The live database file, or a ClickException saying what to use instead of this command."""
    url = db.engine.url
    if url.get_backend_name() == "sqlite":
        return Path(url.database).resolve()
    shown = make_url(url.render_as_string(hide_password=False)).set(
        drivername="postgresql", password=None
    )
    raise click.ClickException(
        "The database is PostgreSQL: back it up with pg_dump, which copies a consistent snapshot "
        "while the service writes (give the password in PGPASSWORD or ~/.pgpass):\n"
        f"    pg_dump --format=custom --file BACKUP.dump '{shown.render_as_string()}'\n"
        "and restore it with pg_restore --clean --if-exists --dbname '...' BACKUP.dump."
    )


def copy_database(source: Path, destination: Path) -> None:
    """Copy one SQLite database onto another with the online backup API, in one step."""
    with (
        closing(sqlite3.connect(source)) as reader,
        closing(sqlite3.connect(destination)) as writer,
    ):
        reader.backup(writer, pages=-1)


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


@click.command("backup")
@with_appcontext
@click.argument("destination", type=click.Path(dir_okay=False, path_type=Path))
def backup_command(destination):
    """Copy the live SQLite database to DESTINATION (a new file) while the service serves."""
    source = sqlite_path()
    if destination.exists():
        raise click.ClickException(f"{destination} exists already: give a new file.")
    copy_database(source, destination)
    count = check_copy(destination)
    click.echo(f"Backed up {source} to {destination}: {count} animals, integrity check ok.")


@click.command("restore")
@with_appcontext
@click.argument("source", type=click.Path(exists=True, dir_okay=False, path_type=Path))
def restore_command(source):
    """Put the backup SOURCE in place of the SQLite database. Stop the service first."""
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
    click.echo(f"Restored {source} to {destination}: {count} animals. Start the service again.")
