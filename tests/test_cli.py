"""`flask keys create/list/revoke`, the only way keys are made and retired; every data command
saying which database it uses and refusing one without the schema; the documented commands."""

import os
import re
import shlex
import shutil
import socket
import sqlite3
import subprocess
import sys
from contextlib import closing
from datetime import UTC, datetime, timedelta
from pathlib import Path

import click
import pytest
from alembic.script import ScriptDirectory
from conftest import (
    IN_SQLITE_PASS,
    PROJECT_DIR,
    TEST_DATABASE_URL,
    break_release,
    copy_release,
    fill,
    migrate_to_head,
    mounted_tmpfs,
    start_own_cluster,
)
from flask_migrate import upgrade
from nginx_server import free_port, stop_process, wait_for_port

from animal_store import create_app
from animal_store.access import last_used
from animal_store.access.auth import issue_key
from animal_store.data.database import describe_database
from animal_store.data.models import IdempotencyRecord
from animal_store.extensions import db
from animal_store.version import VERSION


def test_keys_create_prints_a_working_key_as_last_line(client, runner):
    result = runner.invoke(args=["keys", "create", "shop-frontend"])
    assert result.exit_code == 0
    key = result.output.strip().splitlines()[-1]
    assert key.startswith("ask_")
    assert client.get("/v1/pets", headers={"Authorization": f"Bearer {key}"}).status_code == 200


def test_keys_create_refuses_a_taken_name(runner):
    assert runner.invoke(args=["keys", "create", "shop"]).exit_code == 0
    result = runner.invoke(args=["keys", "create", "shop"])
    assert result.exit_code != 0
    assert "exists already" in result.output


@pytest.mark.parametrize("name", ["", "x" * 101])
def test_keys_create_refuses_bad_names(runner, name):
    result = runner.invoke(args=["keys", "create", name])
    assert result.exit_code != 0


def test_keys_list_shows_metadata_never_the_key(client, runner):
    key = runner.invoke(args=["keys", "create", "alpha"]).output.strip().splitlines()[-1]
    beta = ["keys", "create", "beta", "--rate-limit", "100/second", "--scopes", "read"]
    runner.invoke(args=[*beta, "--expires", "2099-06-30T00:00:00Z"])
    client.get("/v1/pets", headers={"Authorization": f"Bearer {key}"})
    assert last_used.flush(timeout=10)  # its last-used time, written off the request's path
    runner.invoke(args=["keys", "revoke", "beta"])
    result = runner.invoke(args=["keys", "list"])
    assert result.exit_code == 0
    assert key not in result.output
    assert key[4:20] not in result.output
    header, alpha, beta = result.stdout.strip().splitlines()
    assert header.split() == [
        "NAME",
        "PREFIX",
        "SCOPES",
        "EXPIRES",
        "RATE",
        "LIMIT",
        "CREATED",
        "LAST",
        "USED",
        "STATE",
    ]
    today = datetime.now(UTC).strftime("%Y-%m-%d")
    assert alpha.split()[:4] == ["alpha", key[:10] + "...", "read,write", "never"]
    assert "6000 per minute (default)" in alpha
    assert alpha.count(today) == 2  # created and last used
    assert alpha.endswith("active")
    assert beta.split()[2:4] == ["read", "2099-06-30"]
    assert "100/second" in beta
    assert "never" in beta  # never used
    assert f"revoked {today}" in beta


def test_keys_revoke_unknown_or_twice_fails(runner):
    assert runner.invoke(args=["keys", "revoke", "ghost"]).exit_code != 0
    runner.invoke(args=["keys", "create", "once"])
    assert runner.invoke(args=["keys", "revoke", "once"]).exit_code == 0
    result = runner.invoke(args=["keys", "revoke", "once"])
    assert result.exit_code != 0
    assert "revoked already" in result.output


def test_format_time_is_utc():
    from animal_store.commands.cli import format_time

    moment = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC) + timedelta(0)
    assert format_time(moment) == "2026-01-02 03:04:05 UTC"
    assert format_time(None) == "never"


# quickstart on a port that is taken: the key works there only if the program on it says so.

QUICKSTART = [sys.executable, "-m", "flask", "--app", "animal_store", "quickstart", "--port"]
# The virtualenv's `flask` itself, the command an operator types.
FLASK = str(Path(sys.executable).parent / "flask")


@pytest.fixture
def start_program(tmp_path):
    """Start a program with a free loopback port as its last argument and return the port; each
    is stopped by PID afterwards."""
    processes = []

    def start(command, env=None):
        port = free_port()
        log = tmp_path / f"program-{len(processes)}.log"
        with log.open("wb") as out:
            processes.append(
                subprocess.Popen(
                    [*command, str(port)],
                    cwd=tmp_path,
                    env={**os.environ, **(env or {})},
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )
            )
        wait_for_port(processes[-1], port, shlex.join(command), log.read_text, timeout=60)
        return port

    yield start
    for process in processes:
        stop_process(process, timeout=10)


def frozen_redis(request, start_program):
    server = request.getfixturevalue("own_redis")
    server.freeze()  # it takes connections (the kernel does) and never answers
    return server.port


# A raw TCP server that speaks first, and no HTTP, as an SSH server does.
SPEAKS_FIRST = """
import socket, sys
with socket.create_server(("127.0.0.1", int(sys.argv[1]))) as server:
    while True:
        connection, _ = server.accept()
        try:
            connection.sendall(b"SSH-2.0-OpenSSH_9.6\\r\\n")
            while connection.recv(65536):
                pass
        except OSError:
            pass
        connection.close()
"""

# What holds the port, and what quickstart then says it answered.
OTHER_PROGRAMS = {
    "a raw TCP server": (
        lambda request, start_program: start_program([sys.executable, "-c", SPEAKS_FIRST]),
        "it does not speak HTTP: it answered 'SSH-2.0-OpenSSH_9.6'",
    ),
    "python -m http.server": (
        lambda request, start_program: start_program(
            [sys.executable, "-m", "http.server", "--bind", "127.0.0.1"]
        ),
        "it answered 404 File not found",
    ),
    "a Redis": (
        lambda request, start_program: request.getfixturevalue("own_redis").port,
        # Redis drops a connection that sends it "Host:" (an HTTP request), unanswered.
        "it closed the connection without an answer",
    ),
    "a Redis that does not answer": (
        frozen_redis,
        "it did not answer within 5 seconds",
    ),
    "an Animal Store on another database": (
        lambda request, start_program: start_program(
            QUICKSTART, {"DATABASE_URL": f"sqlite:///{request.getfixturevalue('tmp_path')}/b.db"}
        ),
        'it answered 401 UNAUTHORIZED ("The API key is not valid, has expired or has been '
        'revoked.")',
    ),
}


@IN_SQLITE_PASS  # quickstart's own (conftest.py)
@pytest.mark.parametrize(("hold", "answer"), OTHER_PROGRAMS.values(), ids=OTHER_PROGRAMS.keys())
def test_quickstart_on_a_port_another_program_holds_refuses_and_revokes_the_key(
    request, runner, start_program, hold, answer
):
    port = hold(request, start_program)
    result = runner.invoke(args=["quickstart", "--port", str(port)])
    assert result.exit_code == 1, result.output
    assert isinstance(result.exception, SystemExit)  # a ClickException, not a traceback
    refusal = result.stderr.splitlines()[-1]
    assert refusal.startswith(
        f"Error: 127.0.0.1:{port} is held by another program, not an Animal Store on this "
        f"database: to GET /v1/pets with the new key, {answer}."
    ), refusal
    # The key went to that program: it is revoked, and never shown.
    assert "ask_" not in result.output
    (name,) = re.findall(r"The key '(quickstart-[\d-]+)' is revoked", refusal)
    (listed,) = [line for line in runner.invoke(args=["keys", "list"]).stdout.splitlines()[1:]]
    assert listed.startswith(name)
    assert " revoked " in listed


def test_quickstart_again_while_its_server_runs_makes_a_working_key_and_exits(
    client, runner, start_program, database_url
):
    # The first quickstart's server holds the port; the second run only makes another key.
    port = start_program(QUICKSTART, {"DATABASE_URL": database_url})
    result = runner.invoke(args=["quickstart", "--port", str(port)])
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[-1] == (
        f"An Animal Store on this database already serves 127.0.0.1:{port} and accepted the new "
        "key: no second server is started."
    )
    (key,) = re.findall(r"\(shown only now\): (ask_\S+)", result.output)
    assert client.get("/v1/pets", headers={"Authorization": f"Bearer {key}"}).status_code == 200


def test_quickstart_in_the_second_of_an_earlier_one_names_its_key_apart(runner, start_program):
    # An earlier quickstart's key of this second (and of the next, should it turn meanwhile).
    now = datetime.now(UTC)
    for moment in (now, now + timedelta(seconds=1)):
        name = "quickstart-" + moment.strftime("%Y%m%d-%H%M%S")
        assert runner.invoke(args=["keys", "create", name]).exit_code == 0
    port = start_program([sys.executable, "-m", "http.server", "--bind", "127.0.0.1"])
    result = runner.invoke(args=["quickstart", "--port", str(port)])
    assert result.exit_code == 1, result.output
    assert re.search(r"The key 'quickstart-\d{8}-\d{6}-2' is revoked", result.stderr), result.stderr


def test_quickstart_on_an_address_not_this_machines_refuses_before_making_a_key(runner):
    # 192.0.2.1 is TEST-NET-1 (RFC 5737): no machine's own address.
    result = runner.invoke(args=["quickstart", "--host", "192.0.2.1", "--port", "5000"])
    assert result.exit_code == 1, result.output
    assert result.stderr.splitlines()[-1] == (
        "Error: Cannot serve on 192.0.2.1:5000: Cannot assign requested address."
    )
    assert runner.invoke(args=["keys", "list"]).stdout.splitlines()[1:] == []


@IN_SQLITE_PASS  # quickstart's own (conftest.py)
def test_quickstart_says_its_database_once(tmp_path, start_program):
    # It migrates in process, and the migration says which database too.
    port = start_program([sys.executable, "-m", "http.server", "--bind", "127.0.0.1"])
    result = subprocess.run(
        [*QUICKSTART, str(port)],
        cwd=tmp_path,
        env={**os.environ, "DATABASE_URL": f"sqlite:///{tmp_path}/store.sqlite3"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1, result.stderr
    assert "is held by another program" in result.stderr
    said = (result.stdout + result.stderr).count(f"Database: sqlite:///{tmp_path}/store.sqlite3")
    assert said == 1, result.stderr


# Which database a command uses, and a database without the schema.

OPERATOR_SETTINGS = {
    "DATABASE_URL alone": (
        {"DATABASE_URL": "sqlite:///{path}"},
        "DATABASE_URL from the environment; ANIMAL_STORE_ENV is unset",
    ),
    "a deployment's settings file": (
        {
            "ANIMAL_STORE_ENV": "staging",
            "DATABASE_URL": "sqlite:///{path}",
            "ANIMAL_STORE_RATELIMIT_STORAGE_URI": "memory://",
        },
        "DATABASE_URL from the environment, through config/staging.py, as ANIMAL_STORE_ENV=staging",
    ),
    "ANIMAL_STORE_DATABASE_URL": (
        {"ANIMAL_STORE_DATABASE_URL": "sqlite:///{path}"},
        "ANIMAL_STORE_DATABASE_URL from the environment",
    ),
    "nothing set": (
        # The development default, its file moved out of the checkout for the test.
        {"ANIMAL_STORE_SQLITE_FILENAME": "{path}"},
        "the development default: neither ANIMAL_STORE_ENV nor DATABASE_URL is set",
    ),
}


@IN_SQLITE_PASS  # on a SQLite file of its own in either pass (conftest.py)
@pytest.mark.parametrize("case", OPERATOR_SETTINGS.values(), ids=OPERATOR_SETTINGS.keys())
def test_commands_say_which_database_and_where_it_came_from(tmp_path, case):
    settings, source = case
    path = tmp_path / "store.sqlite3"
    migrate_to_head(f"sqlite:///{path}")
    environment = without_deployment()
    environment.update({name: value.format(path=path) for name, value in settings.items()})
    result = subprocess.run(
        [sys.executable, "-m", "flask", "--app", "animal_store", "keys", "list"],
        cwd=PROJECT_DIR,
        env=environment,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines()[0] == f"Database: sqlite:///{path} ({source})"
    assert result.stdout.split()[:2] == ["NAME", "PREFIX"]


@IN_SQLITE_PASS  # on a SQLite file of its own in either pass (conftest.py)
def test_db_upgrade_says_which_database_it_changes(tmp_path):
    path = tmp_path / "store.sqlite3"
    result = subprocess.run(
        [sys.executable, "-m", "flask", "--app", "animal_store", "db", "upgrade"],
        cwd=PROJECT_DIR,
        env={**os.environ, "DATABASE_URL": f"sqlite:///{path}"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    first = result.stderr.splitlines()[0]
    assert first.startswith(f"INFO  [alembic.env] Database: sqlite:///{path} (DATABASE_URL from")
    assert {"alembic_version", "pets", "api_keys"} <= set(tables(path))


def test_the_database_line_masks_the_password():
    app = create_app({"DATABASE_URL": "postgresql://store:s3cret@127.0.0.1:1/store"})
    with app.app_context():
        described = describe_database()
        db.engine.dispose()
    assert described == (
        "postgresql+psycopg://store:***@127.0.0.1:1/store (the settings given to create_app)"
    )


DATA_COMMANDS = [
    ["keys", "create", "shop"],
    ["keys", "list"],
    ["keys", "set-limit", "shop", "default"],
    ["keys", "rotate", "shop"],
    ["keys", "revoke", "shop"],
    ["idempotency", "purge"],
    ["seed", "1"],
    ["backup", "{tmp_path}/backup.sqlite3"],
]


def no_file(path):
    pass


def empty_file(path):
    path.write_bytes(b"")


def older_schema(path):
    app = create_app({"DATABASE_URL": f"sqlite:///{path}"})
    with app.app_context():
        upgrade(revision="0003")
        db.engine.dispose()


def unknown_schema(path):
    migrate_to_head(f"sqlite:///{path}")
    with closing(sqlite3.connect(path)) as connection, connection:
        connection.execute("UPDATE alembic_version SET version_num = '0099'")


def tables(path):
    """The tables of a SQLite file, None where there is no file."""
    if not path.exists():
        return None
    with closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as connection:
        return sorted(row[0] for row in connection.execute("SELECT name FROM sqlite_master"))


# The newest migration, whichever it is now.
HEAD = ScriptDirectory(PROJECT_DIR / "animal_store" / "migrations").get_current_head()
UPGRADE = "run `flask --app animal_store db upgrade` first."
DATABASES_WITHOUT_THE_SCHEMA = {
    "no file": (no_file, "No database file {path}: " + UPGRADE),
    "an empty file": (empty_file, "The database has no schema: " + UPGRADE),
    "an older schema": (
        older_schema,
        f"The database's schema is at migration 0003, this code's at {HEAD}: " + UPGRADE,
    ),
    "a newer schema": (
        unknown_schema,
        "The database's schema is at migration 0099, which this code does not have",
    ),
}


@pytest.mark.parametrize("command", DATA_COMMANDS, ids=" ".join)
@pytest.mark.parametrize(
    "database", DATABASES_WITHOUT_THE_SCHEMA.values(), ids=DATABASES_WITHOUT_THE_SCHEMA.keys()
)
def test_commands_refuse_a_database_without_the_schema(tmp_path, command, database):
    make, message = database
    path = tmp_path / "store.sqlite3"
    make(path)
    before = tables(path)
    app = create_app({"DATABASE_URL": f"sqlite:///{path}"})
    result = app.test_cli_runner().invoke(args=[word.format(tmp_path=tmp_path) for word in command])
    with app.app_context():
        db.engine.dispose()
    assert result.exit_code == 1
    assert isinstance(result.exception, SystemExit)  # a ClickException, not a traceback
    assert f"Error: {message.format(path=path)}" in result.stderr
    assert result.stderr.startswith(f"Database: sqlite:///{path} ")
    assert result.stdout == ""
    # Nothing created.
    assert tables(path) == before
    assert not (tmp_path / "backup.sqlite3").exists()


def test_a_database_that_does_not_answer_is_one_line():
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    app = create_app({"DATABASE_URL": f"postgresql://store:s3cret@127.0.0.1:{port}/store"})
    result = app.test_cli_runner().invoke(args=["keys", "list"])
    with app.app_context():
        db.engine.dispose()
    assert result.exit_code == 1
    assert isinstance(result.exception, SystemExit)
    assert "Error: Cannot use the database: connection failed:" in result.stderr
    assert "Connection refused" in result.stderr
    assert "s3cret" not in result.output


@IN_SQLITE_PASS  # on a SQLite file of its own in either pass (conftest.py)
def test_a_command_without_the_deployment_environment_says_so_and_creates_nothing(tmp_path):
    environment = without_deployment(tmp_path / "animal_store.sqlite3")
    result = subprocess.run(
        [sys.executable, "-m", "flask", "--app", "animal_store", "keys", "create", "shop"],
        cwd=PROJECT_DIR,
        env=environment,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert "the development default: neither ANIMAL_STORE_ENV nor DATABASE_URL is set" in (
        result.stderr
    )
    assert f"No database file {tmp_path}/animal_store.sqlite3: {UPGRADE}" in result.stderr
    assert "Traceback" not in result.stderr
    assert "ask_" not in result.stdout
    assert list(tmp_path.iterdir()) == []


@IN_SQLITE_PASS  # on a SQLite file of its own in either pass (conftest.py)
def test_version_prints_the_services_release_and_touches_no_database(tmp_path):
    # The real `flask` of the virtualenv, as an operator types it; with no deployment
    # environment, so a database it opened would be the development file named here.
    environment = without_deployment(tmp_path / "animal_store.sqlite3")
    result = subprocess.run(
        [FLASK, "--app", "animal_store", "version"],
        cwd=tmp_path,
        env=environment,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    # The words of each worker's "Worker ready" line and of /metrics' build info.
    assert result.stdout == f"animal-store {VERSION}\n"
    assert list(tmp_path.iterdir()) == []


# docs/operations.rst: every command as it is typed on the deployed machine.

DEPLOYED_FLASK = ".venv/bin/flask --app animal_store "


def documented_commands():
    """The commands of operations.rst's literal blocks and inline literals that run flask."""
    text = (PROJECT_DIR / "docs" / "operations.rst").read_text()
    text = re.sub(r"\\\n\s*", " ", text)  # a command continued on the next line
    blocks = re.findall(r"^ {4,}\S.*$", text, re.MULTILINE)
    inline = re.findall(r"``(.+?)``", text.replace("\n", " "))
    # From the word that runs flask to the end or a comment, after a shell prefix such as cron's.
    commands = [re.search(r"[\w./-]*\bflask [^`#]*", line) for line in blocks + inline]
    return [command[0].strip() for command in commands if command]


def test_operations_shows_every_command_as_typed_on_the_deployed_machine(runner):
    commands = documented_commands()
    assert len(commands) >= 15
    for command in commands:
        assert command.startswith(DEPLOYED_FLASK), command
        # --help is handled first: the words name a command, and its options exist.
        words = shlex.split(command.removeprefix(DEPLOYED_FLASK))
        result = runner.invoke(args=[*words, "--help"])
        assert result.exit_code == 0, f"{command}: {result.output}"


# A database a command cannot use, refused in one line by every command that touches one:
# a wrong password (on a cluster of the test's own: the shared server trusts every local
# connection), a host that does not answer, a database that does not exist.

TOUCHING_THE_DATABASE = [
    ["db", "upgrade"],
    ["db", "downgrade"],
    ["db", "current"],
    ["db", "stamp", "head"],
    ["db", "check"],
    ["db", "migrate"],
    *DATA_COMMANDS,
    ["restore", "{tmp_path}/existing.dump"],
    ["quickstart", "--port", "{taken_port}"],
]
# The others: Alembic's that read only the migrations, and those that print documents.
NOT_TOUCHING_THE_DATABASE = {
    "db list-templates",
    "db init",
    "db revision",
    "db edit",
    "db merge",
    "db show",
    "db history",
    "db heads",
    "db branches",
    "openapi",
    "errors table",
    "errors nginx",
    "version",
}
ROLE = "shop"
ROLE_PASSWORD = "Pa55-w0rd-never-printed"  # noqa: S105


def command_names(command, path=()):
    if isinstance(command, click.Group):
        for name, child in command.commands.items():
            yield from command_names(child, (*path, name))
    else:
        yield " ".join(path)


def test_the_table_has_every_command_that_touches_the_database():
    names = set(command_names(create_app({"DATABASE_URL": "sqlite://"}).cli))
    # Each command of the table by its name: its first words that name one.
    tried = {
        next(" ".join(command[:n]) for n in (2, 1) if " ".join(command[:n]) in names)
        for command in TOUCHING_THE_DATABASE
    }
    assert tried | NOT_TOUCHING_THE_DATABASE == names
    assert not tried & NOT_TOUCHING_THE_DATABASE


@pytest.fixture(scope="module")
def password_cluster():
    cluster = start_own_cluster(passwords=True)
    cluster.create_role(ROLE, ROLE_PASSWORD)
    cluster.create_database("store", owner=ROLE)
    yield cluster
    cluster.stop()


def closed_port():
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


UNUSABLE_DATABASES = {
    "a wrong password": (
        lambda port: f"postgresql://{ROLE}:wrong-{ROLE_PASSWORD}@127.0.0.1:{port}/store",
        f'password authentication failed for user "{ROLE}"',
    ),
    "a host that does not answer": (
        lambda port: f"postgresql://{ROLE}:{ROLE_PASSWORD}@127.0.0.1:{closed_port()}/store",
        "Connection refused",
    ),
    "a database that does not exist": (
        lambda port: f"postgresql://{ROLE}:{ROLE_PASSWORD}@127.0.0.1:{port}/no_such_store",
        'database "no_such_store" does not exist',
    ),
}


@pytest.mark.parametrize("command", TOUCHING_THE_DATABASE, ids=" ".join)
@pytest.mark.parametrize("database", UNUSABLE_DATABASES.values(), ids=UNUSABLE_DATABASES.keys())
def test_every_command_refuses_a_database_it_cannot_use_in_one_line(
    password_cluster, tmp_path, command, database
):
    make_url, problem = database
    url = make_url(password_cluster.port)
    (tmp_path / "existing.dump").write_bytes(b"a backup")
    app = create_app({"DATABASE_URL": url})
    with socket.create_server(("127.0.0.1", 0)) as taken:  # were quickstart to get to serving
        words = [
            word.format(tmp_path=tmp_path, taken_port=taken.getsockname()[1]) for word in command
        ]
        result = app.test_cli_runner().invoke(args=words)
    with app.app_context():
        db.engine.dispose()
    assert result.exit_code == 1, result.output
    assert isinstance(result.exception, SystemExit)  # a ClickException, not a traceback
    # On stderr, the database line every such command starts with, then the refusal; no more.
    assert result.stdout == ""
    database_line, refusal = result.stderr.splitlines()
    assert f"Database: postgresql+psycopg://{ROLE}:***@127.0.0.1:" in database_line
    assert refusal.startswith("Error: Cannot use the database: connection failed: ")
    assert problem in refusal
    assert ROLE_PASSWORD not in result.stderr
    assert sorted(path.name for path in tmp_path.iterdir()) == ["existing.dump"]


# A fault met while a command runs, once its database has answered: a full disk, and a server that
# takes only reads (a standby; here a database with default_transaction_read_only). Every command
# that writes says it in one line too, each with the migration its database is at to write.

PREVIOUS = (
    ScriptDirectory(PROJECT_DIR / "animal_store" / "migrations").get_revision(HEAD).down_revision
)
WRITING_COMMANDS = {
    "keys create": (["keys", "create", "shop-2"], HEAD),
    "keys set-limit": (["keys", "set-limit", "shop", "5/second"], HEAD),
    "keys rotate": (["keys", "rotate", "shop"], HEAD),
    "keys revoke": (["keys", "revoke", "shop"], HEAD),
    "idempotency purge": (["idempotency", "purge"], HEAD),
    "seed": (["seed", "1"], HEAD),
    "quickstart": (["quickstart", "--port", "{taken_port}"], HEAD),
    "db upgrade": (["db", "upgrade"], PREVIOUS),
    "db downgrade": (["db", "downgrade"], HEAD),
    "db stamp": (["db", "stamp", PREVIOUS], HEAD),
}
FULL_DISK = (
    "Error: The database has no space left for writes: database or disk is full. Free space on "
    "its disk, then run the command again."
)

# The statement refused: INSERT, UPDATE, DELETE, COPY FROM, DROP TRIGGER...
READ_ONLY = (
    r"Error: The database takes only reads: cannot execute [A-Z ]+ in a read-only transaction\. "
    r"DATABASE_URL names a standby, or a database set read-only: give it the primary's\."
)


def prepare(url, revision):
    """Migrate the database to `revision`; at the newest, give it the key 'shop' and an expired
    Idempotency-Key, so that every command of WRITING_COMMANDS has something to write."""
    app = create_app({"DATABASE_URL": url})
    with app.app_context():
        upgrade(revision=revision)
        if revision == HEAD:
            api_key, _ = issue_key("shop")
            db.session.flush()
            past = datetime.now(UTC) - timedelta(days=2)
            db.session.add(
                IdempotencyRecord(
                    api_key_id=api_key.id,
                    target_hash=bytes(32),
                    key="spent",
                    fingerprint=bytes(32),
                    claim="0" * 32,
                    claimed_at=past,
                    expires_at=past,
                )
            )
            db.session.commit()
        db.engine.dispose()


def run_command(url, words, tmp_path):
    app = create_app({"DATABASE_URL": url})
    with socket.create_server(("127.0.0.1", 0)) as taken:  # were quickstart to get to serving
        words = [
            word.format(tmp_path=tmp_path, taken_port=taken.getsockname()[1]) for word in words
        ]
        result = app.test_cli_runner().invoke(args=words)
    with app.app_context():
        db.engine.dispose()
    return result


def refusal(result):
    """The one line a command ended with: no traceback, nothing on stdout, and nothing on stderr
    but that line, the database line and Alembic's lines of what it began."""
    assert result.exit_code == 1, result.output
    assert isinstance(result.exception, SystemExit)  # a ClickException, not a traceback
    assert result.stdout == ""
    said = [line for line in result.stderr.splitlines() if not line.startswith("INFO  [alembic")]
    assert said[0].startswith("Database: ") or said[0].startswith("Error: "), said
    (error,) = said[1:] if said[0].startswith("Database: ") else said
    return error


@pytest.fixture(scope="module")
def sqlite_at(tmp_path_factory):
    """A SQLite file prepared at each revision asked for, made once for the module, to copy."""
    files = {}

    def file_at(revision):
        if revision not in files:
            files[revision] = tmp_path_factory.mktemp("prepared") / "store.sqlite3"
            prepare(f"sqlite:///{files[revision]}", revision)
        return files[revision]

    return file_at


@pytest.mark.parametrize("command", WRITING_COMMANDS.values(), ids=WRITING_COMMANDS.keys())
def test_every_command_that_writes_says_a_full_disk_in_one_line(tmp_path, sqlite_at, command):
    if TEST_DATABASE_URL:
        pytest.skip("runs in the pass without TEST_DATABASE_URL: a SQLite file of its own")
    words, revision = command
    with mounted_tmpfs(tmp_path / "tmpfs"):
        path = tmp_path / "tmpfs" / "store.sqlite3"
        shutil.copyfile(sqlite_at(revision), path)
        # The service holds the file open, as while it serves: the write-ahead log is there, so
        # the command reads, and finds no room to write. (With the file closed everywhere, opening
        # it needs room too, and SQLite says "disk I/O error", which the commands say as well.)
        with closing(sqlite3.connect(path)) as service:
            service.execute("SELECT count(*) FROM alembic_version").fetchall()
            fill(tmp_path / "tmpfs")
            result = run_command(f"sqlite:///{path}", words, tmp_path)
    assert refusal(result) == FULL_DISK


@pytest.fixture(scope="module")
def read_only_at(password_cluster):
    """A database of the password cluster prepared at each revision asked for, then set to take
    only reads, made once for the module: nothing a command tries is written."""
    urls = {}

    def url_at(revision):
        if revision not in urls:
            name = f"read_only_{len(urls)}"
            password_cluster.create_database(name, owner=ROLE)
            urls[revision] = (
                f"postgresql://{ROLE}:{ROLE_PASSWORD}@127.0.0.1:{password_cluster.port}/{name}"
            )
            prepare(urls[revision], revision)
            password_cluster.sql(f"ALTER DATABASE {name} SET default_transaction_read_only = on")
        return urls[revision]

    return url_at


@pytest.mark.parametrize("command", WRITING_COMMANDS.values(), ids=WRITING_COMMANDS.keys())
def test_every_command_that_writes_says_a_read_only_database_in_one_line(
    tmp_path, read_only_at, command
):
    words, revision = command
    error = refusal(run_command(read_only_at(revision), words, tmp_path))
    assert re.fullmatch(READ_ONLY, error), error


@pytest.mark.parametrize("command", [("db", "upgrade"), ("keys", "list")])
def test_a_command_of_an_unimportable_release_ends_with_its_import_error(tmp_path, command):
    # Not "No such command 'db'", which points at a missing Flask-Migrate.
    release = copy_release(tmp_path / "release")
    said = break_release(release)
    result = subprocess.run(
        [sys.executable, "-m", "flask", "--app", "animal_store", *command],
        cwd=release,
        env={**os.environ, "DATABASE_URL": f"sqlite:///{tmp_path / 'store.sqlite3'}"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert "No such command" not in result.stderr
    assert result.stderr.splitlines()[-1] == said
    assert result.stderr.count(said) == 1
    assert result.stderr.count("Traceback") == 1


def without_deployment(development_file=None) -> dict[str, str]:
    """This environment without a deployment's variables (DATABASE_URL, ANIMAL_STORE_*), with
    the development database at `development_file` if given."""
    environment = {
        name: value
        for name, value in os.environ.items()
        if name != "DATABASE_URL" and not name.startswith("ANIMAL_STORE_")
    }
    if development_file is not None:
        environment["ANIMAL_STORE_SQLITE_FILENAME"] = str(development_file)
    return environment
