"""No message the service writes holds a database password: the boot's refusal of a malformed
DATABASE_URL (by flask, and in gunicorn's log), the database line of the commands and their
one-line refusals, the backup and restore lines, the log lines of the app under gunicorn.

The password is one no test could miss, and each output checked must name the user and the host
as well, so that it proves something about the database was said."""

import json
import os
import subprocess
import sys
import uuid
from urllib.parse import quote

import pytest
import requests
from conftest import IN_SQLITE_PASS, PROJECT_DIR, Gunicorn, start_own_cluster
from sqlalchemy.engine import make_url
from test_gunicorn import GUNICORN, refused_boot

from animal_store import create_app
from animal_store.data.database import describe_database
from animal_store.extensions import db
from animal_store.settings import SettingsError, masked_url

PASSWORD = "Pa55-w0rd-never-printed"  # noqa: S105
# The password and each piece of it: a URL that breaks it at an @ would show the rest as a host.
PIECES = (PASSWORD, quote(PASSWORD, safe=""), "Pa55", "w0rd", "never-printed")
USER = "shop_owner"


def assert_no_password(output):
    for piece in PIECES:
        assert piece not in output, output


def assert_masked(output, user=USER):
    """Something about the database was said (its user and host), and no piece of the
    password."""
    assert user in output, output
    assert "127.0.0.1" in output, output
    assert_no_password(output)


def operator_environment(**settings):
    """The environment of a shell with the given settings and none of the test run's."""
    environment = {
        name: value
        for name, value in os.environ.items()
        if name != "DATABASE_URL" and not name.startswith("ANIMAL_STORE_")
    }
    return {**environment, **settings}


def flask(*args, **settings):
    return subprocess.run(
        [sys.executable, "-m", "flask", "--app", "animal_store", *args],
        cwd=PROJECT_DIR,
        env=operator_environment(**settings),
        capture_output=True,
        text=True,
        timeout=120,
    )


# The one function that masks a URL: parsed, or as given, even where nothing can parse it.

MASKED = {
    "a password": (
        f"postgresql://store:{PASSWORD}@127.0.0.1/store",
        "postgresql://store:***@127.0.0.1/store",
    ),
    "an @ and a / in the password": (
        "postgresql://store:Pa55@w0rd/never-printed@127.0.0.1/store",
        "postgresql://store:***@127.0.0.1/store",
    ),
    "an @ and a : in the password": (
        "postgresql://store:Pa55@w0rd:never-printed@127.0.0.1:5432/store",
        "postgresql://store:***@127.0.0.1:5432/store",
    ),
    "several hosts, libpq's form": (
        f"postgresql://store:{PASSWORD}@127.0.0.1:5432,127.0.0.2:5432/store",
        "postgresql://store:***@127.0.0.1:5432,127.0.0.2:5432/store",
    ),
    "no scheme": (f"store:{PASSWORD}@127.0.0.1/store", "store:***@127.0.0.1/store"),
    "Redis, no user": (
        f"redis://:{PASSWORD}@127.0.0.1:6379/0",
        "redis://:***@127.0.0.1:6379/0",
    ),
    "the password in the query": (
        f"postgresql://store@127.0.0.1/store?sslmode=require&password={PASSWORD}",
        "postgresql://store@127.0.0.1/store?sslmode=require&password=***",
    ),
    "no password": ("postgresql://store@127.0.0.1/store", "postgresql://store@127.0.0.1/store"),
    "a SQLite file": ("sqlite:////var/lib/store.sqlite3", "sqlite:////var/lib/store.sqlite3"),
    "not a URL": ("the database", "the database"),
}


@pytest.mark.parametrize(("given", "shown"), MASKED.values(), ids=MASKED.keys())
def test_a_url_as_given_is_masked(given, shown):
    assert masked_url(given) == shown


def test_a_parsed_url_is_masked():
    url = make_url(f"postgresql+psycopg://store:{quote(PASSWORD, safe='')}@127.0.0.1:5/store")
    assert masked_url(url) == "postgresql+psycopg://store:***@127.0.0.1:5/store"
    assert masked_url(url.update_query_dict({"password": PASSWORD})).endswith("?password=***")


def test_the_database_line_masks_a_password_in_the_query():
    app = create_app({"DATABASE_URL": f"postgresql://{USER}@127.0.0.1:1/store?password={PASSWORD}"})
    with app.app_context():
        described = describe_database()
        db.engine.dispose()
    assert described.startswith(f"postgresql+psycopg://{USER}@127.0.0.1:1/store?password=*** ")


# The boot: a DATABASE_URL it refuses is said with its password masked. The mistake of deploy
# step 3, a password not percent-encoded, is said as such: SQLAlchemy reads the URL, or not, but
# with the password's @ taken for the one before the host.

MALFORMED = {
    "an @ and a / in the password": (
        f"postgresql://{USER}:Pa55@w0rd/never-printed@127.0.0.1/store",
        "its password holds an @",
    ),
    "an @ and a : in the password": (
        f"postgresql://{USER}:Pa55@w0rd:never-printed@127.0.0.1:5432/store",
        "its password holds an @",
    ),
    "an @ in the password": (
        f"postgresql://{USER}:Pa55@w0rd-never-printed@127.0.0.1:5432/store",
        "its password holds an @",
    ),
    "a port that is no number": (
        f"postgresql://{USER}:{PASSWORD}@127.0.0.1:54x2/store",
        "expected a database URL",
    ),
    "several hosts, an @ in the password": (
        f"postgresql://{USER}:Pa55@w0rd-never-printed@127.0.0.1:5432,127.0.0.2:5432/store",
        "its password holds an @",
    ),
    "several hosts, a port that is no number": (
        f"postgresql://{USER}:{PASSWORD}@127.0.0.1:5432,127.0.0.2:54x2/store",
        "expected a database URL",
    ),
    "several hosts as SQLAlchemy writes them, a port that is no number": (
        f"postgresql://{USER}:{PASSWORD}@/store?host=127.0.0.1:5432&host=127.0.0.2:54x2",
        "expected a database URL",
    ),
    "a driver it does not use": (
        f"mysql://{USER}:{PASSWORD}@127.0.0.1/store",
        "expected a database URL",
    ),
}
SOURCES = {
    "DATABASE_URL": {},
    "ANIMAL_STORE_DATABASE_URL": {},
    "DATABASE_URL through config/production.py": {"ANIMAL_STORE_ENV": "production"},
}


@pytest.mark.parametrize("source", SOURCES, ids=SOURCES.keys())
@pytest.mark.parametrize(("url", "why"), MALFORMED.values(), ids=MALFORMED.keys())
def test_a_malformed_database_url_is_refused_at_boot_its_password_masked(
    monkeypatch, source, url, why
):
    for name in os.environ:
        if name == "DATABASE_URL" or name.startswith("ANIMAL_STORE_"):
            monkeypatch.delenv(name)
    for name, value in {source.split()[0]: url, **SOURCES[source]}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SettingsError) as refused:
        create_app()
    said = refused.value.format_message()
    assert "\n" not in said
    assert said.startswith("Setting DATABASE_URL ")
    assert why in said
    assert_masked(said)


def test_a_malformed_database_url_given_to_create_app_is_masked():
    with pytest.raises(SettingsError) as refused:
        create_app({"DATABASE_URL": MALFORMED["an @ in the password"][0]})
    said = refused.value.format_message()
    assert said.startswith(f"Setting DATABASE_URL from test_config is 'postgresql://{USER}:***@")
    assert_masked(said)


def test_a_password_in_another_bad_setting_is_masked_too():
    storage = f"http://{USER}:{PASSWORD}@127.0.0.1:6379"  # Redis's, with the wrong scheme
    with pytest.raises(SettingsError) as refused:
        create_app({"DATABASE_URL": "sqlite://", "RATELIMIT_STORAGE_URI": storage})
    assert_masked(refused.value.format_message())


@IN_SQLITE_PASS  # a URL refused before any database is reached (conftest.py)
@pytest.mark.parametrize(("url", "why"), MALFORMED.values(), ids=MALFORMED.keys())
def test_the_flask_command_refuses_a_malformed_database_url_in_one_masked_line(url, why):
    result = flask("keys", "list", DATABASE_URL=url)
    assert result.returncode == 1
    assert result.stdout == ""
    (line,) = result.stderr.splitlines()
    assert line.startswith("Error: Setting DATABASE_URL is ")
    assert why in line
    assert_masked(line)


@IN_SQLITE_PASS  # a URL refused before any database is reached (conftest.py)
@pytest.mark.parametrize(
    "case", ["an @ and a / in the password", "a port that is no number"], ids=str
)
def test_gunicorn_logs_the_refusal_of_a_malformed_database_url_masked(tmp_path, case):
    url, why = MALFORMED[case]
    result = subprocess.run(
        [*GUNICORN, "--bind", "127.0.0.1:0", "--workers", "1"],
        cwd=PROJECT_DIR,
        env=operator_environment(
            DATABASE_URL=url, TMPDIR=str(tmp_path), PROMETHEUS_MULTIPROC_DIR=""
        ),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert result.stderr == ""
    refusal = json.loads(result.stdout.splitlines()[-1])
    assert refusal["level"] == "ERROR"
    assert refusal["message"].startswith("Setting DATABASE_URL is ")
    assert why in refusal["message"]
    assert_masked(refusal["message"])
    assert_masked(result.stdout)  # the journal under systemd


# A database that needs the password, on a cluster of the test's own (the shared server trusts
# every local connection): the commands and the server, with the right password and a wrong one.

LOCKED_USER = "shop_locked"  # whose password is another: PASSWORD is a wrong one for it


@pytest.fixture(scope="module")
def cluster():
    cluster = start_own_cluster(passwords=True)
    cluster.create_role(USER, PASSWORD)
    cluster.create_role(LOCKED_USER, uuid.uuid4().hex)
    yield cluster
    cluster.stop()


@pytest.fixture
def store(cluster):
    """A fresh database owned by USER: its URL with the password, and the same for a role
    PASSWORD is wrong for."""
    name = f"store_{uuid.uuid4().hex[:12]}"
    cluster.create_database(name, owner=USER)
    where = f"127.0.0.1:{cluster.port}/{name}"
    return (
        f"postgresql://{USER}:{PASSWORD}@{where}",
        f"postgresql://{LOCKED_USER}:{PASSWORD}@{where}",
    )


def test_commands_say_the_database_and_back_it_up_and_restore_it_masked(store, tmp_path):
    url, _ = store
    upgrade = flask("db", "upgrade", DATABASE_URL=url)
    assert upgrade.returncode == 0, upgrade.stderr
    assert f"INFO  [alembic.env] Database: postgresql+psycopg://{USER}:***@127.0.0.1:" in (
        upgrade.stderr
    )
    listed = flask("keys", "list", DATABASE_URL=url)
    assert listed.returncode == 0, listed.stderr
    assert listed.stderr.startswith(f"Database: postgresql+psycopg://{USER}:***@127.0.0.1:")
    outputs = [upgrade.stdout, upgrade.stderr, listed.stdout, listed.stderr]
    dump = tmp_path / "store.dump"
    backup = flask("backup", str(dump), DATABASE_URL=url)
    assert backup.returncode == 0, backup.stderr
    assert backup.stdout.startswith(f"Backed up postgresql+psycopg://{USER}:***@127.0.0.1:")
    restore = flask("restore", str(dump), DATABASE_URL=url)
    assert restore.returncode == 0, restore.stderr
    assert f"to postgresql+psycopg://{USER}:***@127.0.0.1:" in restore.stdout
    for output in [*outputs, backup.stdout, backup.stderr, restore.stdout, restore.stderr]:
        assert_no_password(output)


@pytest.mark.parametrize(
    "command",
    [["db", "upgrade"], ["keys", "list"], ["backup", "{tmp_path}/store.dump"]],
    ids=" ".join,
)
def test_a_wrong_password_is_refused_in_one_line_without_it(store, tmp_path, command):
    _, wrong = store
    result = flask(*[word.format(tmp_path=tmp_path) for word in command], DATABASE_URL=wrong)
    assert result.returncode == 1
    assert result.stdout == ""
    database, error = result.stderr.splitlines()
    assert f"Database: postgresql+psycopg://{LOCKED_USER}:***@127.0.0.1:" in database
    assert error.startswith("Error: Cannot use the database: connection failed: ")
    assert f'password authentication failed for user "{LOCKED_USER}"' in error
    assert_masked(result.stderr, user=LOCKED_USER)
    assert list(tmp_path.iterdir()) == []


# What the database says to each login it refuses: a wrong password, none, a role it does not
# have (which it answers as a wrong password, so as not to tell which roles exist).
REFUSED_LOGINS = {
    "a wrong password": (LOCKED_USER, PASSWORD, "password authentication failed for user"),
    "no password": (LOCKED_USER, None, "no password supplied"),
    "an unknown role": ("shop_nobody", PASSWORD, "password authentication failed for user"),
}


@pytest.mark.parametrize(("user", "password", "said"), REFUSED_LOGINS.values(), ids=REFUSED_LOGINS)
def test_a_refused_login_stops_gunicorn_before_any_worker_in_one_line(
    store, tmp_path, user, password, said
):
    url, _ = store
    where = make_url(url)
    credentials = f"{user}:{password}" if password else user
    refused = make_url(f"postgresql://{credentials}@127.0.0.1:{where.port}/{where.database}")
    refusal = refused_boot(tmp_path, {"DATABASE_URL": refused.render_as_string(False)})
    assert len(refusal) == 1
    message = refusal[0]["message"]
    assert message.startswith(
        f"The database refuses the login of role '{user}' to database '{refused.database}' on "
        f"127.0.0.1:{refused.port}: connection failed: "
    )
    assert said in message
    assert message.endswith(
        "Check DATABASE_URL's user and password (postgresql+psycopg://"
        f"{user}{':***' if password else ''}@127.0.0.1:{refused.port}/{refused.database}); "
        "not starting."
    )
    assert_masked(message, user=user)


def test_a_login_refused_after_boot_is_said_by_readyz_and_logged_once(store, cluster, tmp_path):
    url, _ = store
    role = f"shop_rotated_{uuid.uuid4().hex[:8]}"
    cluster.create_role(role, PASSWORD)
    rotated = make_url(url).set(username=role).render_as_string(hide_password=False)
    server = Gunicorn(rotated, workers=1, log_path=tmp_path / "gunicorn.log").wait_until_serving()
    try:
        assert requests.get(server.url + "/readyz", timeout=10).status_code == 200
        # A password changed without the service's settings, its sessions ended (a restart of
        # the database, a rotation).
        cluster.sql(
            f"ALTER ROLE {role} PASSWORD $secret${uuid.uuid4().hex}$secret$;\n"
            f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = '{role}';"
        )
        answers = [requests.get(server.url + "/readyz", timeout=10) for _ in range(3)]
        scraped = requests.get(server.url + "/metrics", timeout=10).text
    finally:
        server.stop()
    for answer in answers:
        assert answer.status_code == 503
        assert answer.headers["Retry-After"] == "5"
        assert answer.json() == {
            "code": "service_unavailable",
            "message": "The database refuses the service's login; retry later.",
            "status": 503,
        }
    assert 'animal_store_database_refusals_total{reason="login_refused"} 3.0' in scraped
    records = [json.loads(line) for line in server.log().splitlines()]
    refusals = [record for record in records if record["level"] in ("WARNING", "ERROR")]
    assert len(refusals) == 1, refusals
    assert refusals[0]["level"] == "ERROR"
    assert refusals[0]["databaseFault"] == "login_refused"
    assert refusals[0]["message"].startswith(
        f"The database refuses the login of role '{role}' to database "
    )
    assert f'password authentication failed for user "{role}"' in refusals[0]["message"]
    assert_masked(server.log(), user=role)
