"""Where the settings come from, each one checked at boot against its declaration, and a
deployment that lacks its secrets or has a bad value refusing to start."""

import ast
import json
import os
import re
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest
import sqlalchemy as sa
from conftest import PROJECT_DIR

from animal_store import contract, create_app, default_settings, settings_schema
from animal_store.extensions import db
from animal_store.settings import SettingsError
from animal_store.settings_schema import (
    SETTING_FIELDS,
    SentinelURI,
    expected,
    parse_sentinel_uri,
    settings_reference,
)

DEFAULTS = {name: getattr(default_settings, name) for name in SETTING_FIELDS}
DOCS = PROJECT_DIR / "docs" / "configuration.rst"


@pytest.fixture
def clean_environment(monkeypatch, tmp_path):
    for name in os.environ:
        if name in ("DATABASE_URL", "DATABASE_READ_URL") or name.startswith("ANIMAL_STORE_"):
            monkeypatch.delenv(name)
    return monkeypatch


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        (
            "postgresql://u:p@db.example:5432/store",
            "postgresql+psycopg://u:p@db.example:5432/store",
        ),
        ("postgres://u@db/store", "postgresql+psycopg://u@db/store"),
        ("postgresql+psycopg://u@db/store", "postgresql+psycopg://u@db/store"),
        ("sqlite:////var/lib/store.db", "sqlite:////var/lib/store.db"),
    ],
)
def test_database_url_maps_postgresql_to_psycopg3(clean_environment, given, expected):
    clean_environment.setenv("DATABASE_URL", given)
    assert create_app().config["SQLALCHEMY_DATABASE_URI"] == expected


def test_default_database_is_sqlite_in_instance_folder(clean_environment):
    app = create_app()
    assert app.config["SQLALCHEMY_DATABASE_URI"] == (
        f"sqlite:///{app.instance_path}/animal_store.sqlite3"
    )


@pytest.mark.parametrize("environment", ["production", "staging"])
def test_deployment_without_database_url_fails_at_boot(clean_environment, environment):
    clean_environment.setenv("ANIMAL_STORE_ENV", environment)
    with pytest.raises(SettingsError, match="needs 'DATABASE_URL'"):
        create_app()


@pytest.mark.parametrize("environment", ["production", "staging"])
def test_deployment_reads_its_settings_file(clean_environment, environment):
    clean_environment.setenv("ANIMAL_STORE_ENV", environment)
    clean_environment.setenv("DATABASE_URL", "postgresql://u@db/store")
    app = create_app()
    assert app.config["SQLALCHEMY_DATABASE_URI"] == "postgresql+psycopg://u@db/store"


def test_the_standbys_url_is_read_from_the_environment_as_the_primarys(clean_environment):
    clean_environment.setenv("DATABASE_URL", "postgresql://store@db1/store")
    clean_environment.setenv(
        "DATABASE_READ_URL", "postgresql://store@db2,db3/store?target_session_attrs=standby"
    )
    app = create_app()
    standbys = app.extensions["animal_store_standbys"]
    try:
        assert standbys.engine.url.drivername == "postgresql+psycopg"
        assert standbys.engine.url.query["host"] == ("db2", "db3")
        assert standbys.engine.url.query["target_session_attrs"] == "standby"
    finally:
        standbys.close()


def test_unknown_deployment_fails_at_boot(clean_environment):
    clean_environment.setenv("ANIMAL_STORE_ENV", "prod")
    with pytest.raises(SettingsError, match="has no file"):
        create_app()


def test_prefixed_environment_variables_override_settings(clean_environment):
    clean_environment.setenv("ANIMAL_STORE_MAX_CONTENT_LENGTH", "1024")
    assert create_app().config["MAX_CONTENT_LENGTH"] == 1024


def test_sqlite_connections_get_wal_busy_timeout_foreign_keys_and_full_sync(app):
    if app.config["SQLALCHEMY_DATABASE_URI"].startswith("postgresql"):
        pytest.skip("SQLite pragmas; this run is on PostgreSQL")
    with app.app_context(), db.engine.connect() as connection:
        pragma = lambda name: connection.execute(sa.text(f"PRAGMA {name}")).scalar()  # noqa: E731
        assert pragma("journal_mode") == "wal"
        assert pragma("busy_timeout") == 5000
        assert pragma("foreign_keys") == 1
        assert pragma("synchronous") == 2  # FULL


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("RATE_LIMIT_ENABLED", "RATELIMIT_ENABLED"),
        ("RATE_LIMIT_STORAGE_URI", "RATELIMIT_STORAGE_URI"),
    ],
)
def test_renamed_setting_stops_the_boot_naming_the_new_one(clean_environment, tmp_path, old, new):
    clean_environment.setenv("DATABASE_URL", f"sqlite:///{tmp_path}/store.sqlite3")
    clean_environment.setenv(f"ANIMAL_STORE_{old}", "false")
    with pytest.raises(SettingsError, match=f"ANIMAL_STORE_{new}"):
        create_app()


@pytest.mark.parametrize("source", ["environment", "test_config"])
def test_cors_methods_stops_the_boot_saying_they_come_from_the_routes(
    clean_environment, tmp_path, source
):
    clean_environment.setenv("DATABASE_URL", f"sqlite:///{tmp_path}/store.sqlite3")
    said = "The setting CORS_METHODS is gone: the methods browsers may use are those the /v1"
    test_config = None
    if source == "environment":
        clean_environment.setenv("ANIMAL_STORE_CORS_METHODS", '["GET"]')
    else:
        test_config = {"CORS_METHODS": ["GET"]}
    with pytest.raises(SettingsError, match=f"^{re.escape(said)}"):
        create_app(test_config)


# Every setting, with values the environment might bring that it must refuse (the text of
# ANIMAL_STORE_<SETTING>); tests/test_settings.py checks that no declared setting is missing.
BAD_VALUES = [
    ("DATABASE_URL", "mysql://store@db/store"),
    ("DATABASE_URL", "postgresql+psycopg2://store@db/store"),
    ("DATABASE_URL", "the database"),
    ("SQLITE_FILENAME", "../store.sqlite3"),
    ("SQLITE_FILENAME", '""'),
    ("MAX_CONTENT_LENGTH", "64k"),
    ("MAX_CONTENT_LENGTH", "0"),
    ("MAX_CONTENT_LENGTH", "65536.5"),
    ("MAX_CONTENT_LENGTH", '"65536"'),
    ("SQLITE_BUSY_TIMEOUT", "-1"),
    ("SQLITE_BUSY_TIMEOUT", "5s"),
    ("SQLALCHEMY_ENGINE_OPTIONS", "pool_pre_ping"),
    ("SQLALCHEMY_ENGINE_OPTIONS", "[]"),
    ("DATABASE_DEADLINE", "0"),
    ("DATABASE_DEADLINE", "NaN"),
    ("DATABASE_CONNECT_TIMEOUT", "1"),
    ("DATABASE_CONNECT_TIMEOUT", "2.5"),
    ("DATABASE_STATEMENT_TIMEOUT", "0"),
    ("DATABASE_POOL_TIMEOUT", "-5"),
    ("ANSWER_CACHE_BYTES", "-1"),
    ("ANSWER_CACHE_BYTES", "8M"),
    ("DATABASE_READ_URL", "mysql://store@db/store"),
    ("DATABASE_READ_URL", "the standbys"),
    ("DATABASE_READ_MAX_LAG", "0"),
    ("DATABASE_BEHIND_PGBOUNCER", "yes"),
    ("DATABASE_BEHIND_PGBOUNCER", '"false"'),
    (
        "GET_PET_DEPRECATION",
        '{"since": "2026-11-22", "sunset": "2030-12-05", "successor": "/v1/pets"}',
    ),
    (
        "GET_PET_DEPRECATION",
        '{"since": "2030-12-05T00:00:00Z", "sunset": "2026-11-22T00:00:00Z", '
        '"successor": "/v1/pets"}',
    ),
    ("GET_PET_DEPRECATION", '{"since": "2026-11-22T00:00:00Z", "sunset": "2030-12-05T00:00:00Z"}'),
    ("KEY_LAST_USED_RESOLUTION", "-1"),
    ("KEY_CACHE_SECONDS", "-1"),
    ("KEY_CACHE_SIZE", "-1"),
    ("KEY_CACHE_SIZE", "1e3"),
    ("OPENAPI_SERVERS", '[{"url": "https://pets.example.net/api"}]'),
    ("OPENAPI_SERVERS", '[{"url": "https://pets.example.net/v1"'),
    ("OPENAPI_SERVERS", '{"url": "https://pets.example.net/v1"}'),
    ("OPENAPI_SERVERS", "[]"),
    ("PUBLIC_URL", "api.example.com"),
    ("PUBLIC_URL", "ftp://api.example.com"),
    ("PUBLIC_URL", "https://"),
    ("PUBLIC_URL", "https://api.example.com/"),
    ("PUBLIC_URL", "https://api.example.com/v1"),
    ("PUBLIC_URL", "https://api.example.com?x=1"),
    ("PUBLIC_URL", "https://user@api.example.com"),
    ("PUBLIC_URL", "https://api.example.com:99999"),
    ("PUBLIC_URL", "https://api.example.com:port"),
    ("OPENAPI_SERVERS", '[{"url": "https://pets.example.net/v1", "title": "Production"}]'),
    ("IDEMPOTENCY_TTL", "0"),
    ("IDEMPOTENCY_LEASE", "0"),
    ("IDEMPOTENCY_PURGE_CHANCE", "1.5"),
    ("IDEMPOTENCY_PURGE_CHANCE", "-0.1"),
    ("READYZ_TIMEOUT", "0"),
    ("DATABASE_RETRY_AFTER", "1.5"),
    ("DATABASE_RETRY_AFTER", "-1"),
    ("REQUEST_QUEUE_TIMEOUT", "-1"),
    ("REQUEST_QUEUE_TIMEOUT", '"10s"'),
    ("REQUEST_HEADER_TIMEOUT", "-1"),
    ("REQUEST_HEADER_TIMEOUT", '"5s"'),
    ("REQUEST_BODY_TIMEOUT", "-1"),
    ("REQUEST_BODY_TIMEOUT", '"5s"'),
    ("LOG_LEVEL", "info"),
    ("LOG_LEVEL", "VERBOSE"),
    ("METRICS_WRITE_INTERVAL", "-1"),
    ("METRICS_WRITE_INTERVAL", '"1s"'),
    ("TRUSTED_PROXIES", "127.0.0.1"),
    ("TRUSTED_PROXIES", '["nginx"]'),
    ("TRUSTED_PROXY_HOPS", "0"),
    ("RATE_LIMIT", "plenty"),
    ("RATE_LIMIT", "null"),
    ("RATELIMIT_ENABLED", "False"),
    ("RATELIMIT_ENABLED", '"off"'),
    ("RATELIMIT_STORAGE_URI", "127.0.0.1:6379"),
    ("RATELIMIT_STORAGE_URI", "http://redis.example:6379/0"),
    # Redis Sentinel: no service name, a Sentinel without its port, a port that is no number,
    # a database that is no number, no Sentinel at all.
    ("RATELIMIT_STORAGE_URI", "redis+sentinel://10.0.0.5:26379,10.0.0.6:26379"),
    ("RATELIMIT_STORAGE_URI", "redis+sentinel://10.0.0.5:26379,10.0.0.6/animal-store"),
    ("RATELIMIT_STORAGE_URI", "redis+sentinel://10.0.0.5:sentinel/animal-store"),
    ("RATELIMIT_STORAGE_URI", "redis+sentinel://10.0.0.5:26379/animal-store/zero"),
    ("RATELIMIT_STORAGE_URI", "redis+sentinel:///animal-store"),
    ("RATELIMIT_SYNC_INTERVAL", "-1"),
    ("RATELIMIT_RETRY_INTERVAL", "0"),
    ("RATELIMIT_STORAGE_OPTIONS", "socket_timeout=1"),
    ("AUTH_FAILURE_LIMIT", "many"),
    ("AUTH_FAILURE_EXEMPT", '["10.0.0.300"]'),
    ("AUTH_FAILURE_EXEMPT", '["10.0.0.0/33"]'),
    ("AUTH_FAILURE_EXEMPT", "10.0.0.0/8"),
    ("KEY_MISS_CACHE_SECONDS", "-1"),
    ("KEY_MISS_CACHE_SIZE", "-1"),
    ("CORS_ORIGINS", "https://shop.example"),
    ("CORS_ORIGINS", '[""]'),
    ("CORS_ALLOW_HEADERS", '["Content Type"]'),
    ("CORS_EXPOSE_HEADERS", '["X-Request-ID:"]'),
    ("CORS_MAX_AGE", "-1"),
    ("CORS_ALWAYS_SEND", '"yes"'),
]


def test_every_setting_has_bad_values_tried():
    assert {name for name, _ in BAD_VALUES} == set(SETTING_FIELDS)


def test_every_default_setting_is_declared_and_every_declared_one_has_a_default():
    defaults = {name for name in dir(default_settings) if name.isupper() and name != "UTC"}
    assert defaults == set(SETTING_FIELDS)


@pytest.mark.parametrize(("name", "text"), BAD_VALUES)
def test_a_bad_setting_from_the_environment_stops_the_boot_in_one_line(
    clean_environment, name, text
):
    clean_environment.setenv(f"ANIMAL_STORE_{name}", text)
    with pytest.raises(SettingsError) as refused:
        create_app()
    said = refused.value.format_message()
    assert said.startswith(f"Setting {name} from ANIMAL_STORE_{name} is {text!r}")
    assert said.endswith(f": expected {expected(name)}.")
    assert "\n" not in said


@pytest.mark.parametrize(
    ("settings", "said"),
    [
        ({"MAX_CONTENT_LENGTH": "64k"}, "Setting MAX_CONTENT_LENGTH from test_config is '64k'"),
        ({"KEY_CACHE_SECONDS": -1}, "Setting KEY_CACHE_SECONDS from test_config is -1"),
        ({"RATELIMIT_ENABLED": "False"}, "Setting RATELIMIT_ENABLED from test_config is 'False'"),
        # A Sentinel without its port: the URL shown, its password never.
        (
            {"RATELIMIT_STORAGE_URI": "redis+sentinel://:hunter2@10.0.0.5:26379,10.0.0.6/x"},
            "Setting RATELIMIT_STORAGE_URI from test_config is "
            "'redis+sentinel://:***@10.0.0.5:26379,10.0.0.6/x': expected ",
        ),
        (
            {"OPENAPI_SERVERS": [{"url": "https://pets.example.net/api"}]},
            "Setting OPENAPI_SERVERS from test_config is [{'url': 'https://pets.example.net/api'}]",
        ),
    ],
)
def test_a_bad_setting_from_test_config_stops_the_boot(settings, said):
    with pytest.raises(SettingsError, match=re.escape(said)):
        create_app({"DATABASE_URL": "sqlite://", **settings})


@pytest.mark.parametrize("environment", ["production", "staging"])
def test_a_bad_database_url_through_the_deployment_file_stops_the_boot(
    clean_environment, environment
):
    clean_environment.setenv("ANIMAL_STORE_ENV", environment)
    clean_environment.setenv("DATABASE_URL", "mysql://store@db/store")
    with pytest.raises(SettingsError) as refused:
        create_app()
    assert refused.value.format_message() == (
        f"Setting DATABASE_URL is 'mysql://store@db/store': expected {expected('DATABASE_URL')}."
    )


# Bad settings of every kind at once: each is named, one line each, in one boot.
EVERY_KIND_OF_BAD_SETTING = {
    "ANIMAL_STORE_RATE_LIMIT_ENABLED": "true",  # renamed
    "ANIMAL_STORE_CORS_METHODS": '["GET"]',  # removed
    "ANIMAL_STORE_MAX_CONTENT_LENTGH": "1",  # no setting
    "ANIMAL_STORE_MAX_CONTENT_LENGTH": "64k",  # a bad value
    "ANIMAL_STORE_LOG_LEVEL": "loud",
}
EVERY_KIND_SAID = [
    "The setting RATE_LIMIT_ENABLED is now RATELIMIT_ENABLED",
    "The setting CORS_METHODS is gone:",
    "ANIMAL_STORE_MAX_CONTENT_LENTGH names no setting",
    "Setting MAX_CONTENT_LENGTH from ANIMAL_STORE_MAX_CONTENT_LENGTH is '64k'",
    "Setting LOG_LEVEL from ANIMAL_STORE_LOG_LEVEL is 'loud'",
]


def test_every_bad_setting_is_said_one_line_each(clean_environment):
    for variable, text in EVERY_KIND_OF_BAD_SETTING.items():
        clean_environment.setenv(variable, text)
    with pytest.raises(SettingsError) as refused:
        create_app()
    lines = refused.value.format_message().splitlines()
    assert [line[: len(said)] for said, line in zip(EVERY_KIND_SAID, lines, strict=True)] == (
        EVERY_KIND_SAID
    )


@pytest.mark.parametrize(
    "variable", ["ANIMAL_STORE_MAX_CONTENT_LENTGH", "ANIMAL_STORE_RATELIMIT", "ANIMAL_STORE_X__Y"]
)
def test_an_environment_variable_that_names_no_setting_stops_the_boot(clean_environment, variable):
    clean_environment.setenv(variable, "1")
    with pytest.raises(SettingsError, match=f"^{variable} names no setting"):
        create_app()


@pytest.mark.parametrize(
    ("variable", "text", "name", "value"),
    [
        ("ANIMAL_STORE_RATELIMIT_ENABLED", "false", "RATELIMIT_ENABLED", False),
        ("ANIMAL_STORE_AUTH_FAILURE_LIMIT", "null", "AUTH_FAILURE_LIMIT", None),
        ("ANIMAL_STORE_LOG_LEVEL", "WARNING", "LOG_LEVEL", "WARNING"),
        ("ANIMAL_STORE_DATABASE_DEADLINE", "2", "DATABASE_DEADLINE", 2.0),
        (
            "ANIMAL_STORE_GET_PET_DEPRECATION__sunset",
            '"2031-01-01T00:00:00Z"',
            "GET_PET_DEPRECATION",
            {
                "since": datetime(2026, 11, 22, tzinfo=UTC),
                "sunset": datetime(2031, 1, 1, tzinfo=UTC),
                "successor": "/v1/pets",
            },
        ),
    ],
)
def test_a_good_setting_from_the_environment_is_loaded_as_its_type(
    clean_environment, variable, text, name, value
):
    clean_environment.setenv(variable, text)
    app = create_app()
    assert app.config[name] == value
    assert getattr(app.extensions["animal_store_settings"], name) == value


def test_a_deprecation_from_the_environment_reaches_the_headers(clean_environment, tmp_path):
    clean_environment.setenv("DATABASE_URL", f"sqlite:///{tmp_path}/unused.sqlite3")
    clean_environment.setenv(
        "ANIMAL_STORE_GET_PET_DEPRECATION",
        '{"since": "2026-11-22T00:00:00Z", "sunset": "2031-01-01T00:00:00+00:00", '
        '"successor": "/v1/pets"}',
    )
    document = create_app().test_client().get("/v1/openapi.json").get_json()
    get_pet = document["paths"]["/pets/{petId}"]["get"]
    assert "removed on 2031-01-01" in get_pet["description"]


def test_the_configuration_docs_list_every_setting_as_declared():
    docs = DOCS.read_text()
    start = docs.index(".. settings-start\n") + len(".. settings-start\n")
    end = docs.index(".. settings-end\n")
    assert docs[start:end].strip("\n") == settings_reference(DEFAULTS).strip("\n"), (
        "docs/configuration.rst is out of date: put settings_reference()'s text "
        "(animal_store/settings_schema.py) between its settings-start and settings-end lines"
    )


def test_the_defaults_written_as_the_environment_would_load_back_as_the_defaults(
    clean_environment,
):
    # The docs show each default in this form: what ANIMAL_STORE_<SETTING> would hold.
    for name, value in DEFAULTS.items():
        as_text = json.dumps(SETTING_FIELDS[name].serialize(name, {name: value}))
        clean_environment.setenv(f"ANIMAL_STORE_{name}", as_text)
    app = create_app()
    assert {name: app.config[name] for name in DEFAULTS} == DEFAULTS


def test_the_flask_command_says_a_bad_setting_in_one_line(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "flask", "--app", "animal_store", "keys", "list"],
        cwd=tmp_path,
        env={
            **os.environ,
            "ANIMAL_STORE_MAX_CONTENT_LENGTH": "64k",
            "PYTHONPATH": str(PROJECT_DIR),
        },
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 1
    assert result.stdout == ""
    assert result.stderr == (
        "Error: Setting MAX_CONTENT_LENGTH from ANIMAL_STORE_MAX_CONTENT_LENGTH is '64k': "
        f"expected {expected('MAX_CONTENT_LENGTH')}.\n"
    )


def test_the_settings_declarations_import_nothing_they_configure():
    # settings_schema.py is the ground floor every layer reads: it may import only what lies
    # below it (contract.py, which imports nothing of the app), never the layers it configures.
    tree = ast.parse(Path(settings_schema.__file__).read_text())
    imported = {
        node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module
    } | {
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    }
    assert {name for name in imported if name.partition(".")[0] == "animal_store"} == {
        "animal_store.contract"
    }
    below = ast.parse(Path(contract.__file__).read_text())
    assert not [node for node in ast.walk(below) if isinstance(node, ast.Import | ast.ImportFrom)]


@pytest.mark.parametrize(
    ("uri", "read"),
    [
        (
            "redis+sentinel://:pass%40word@10.0.0.5:26379,10.0.0.6:26379,[::1]:26379/animal-store",
            SentinelURI(
                [("10.0.0.5", 26379), ("10.0.0.6", 26379), ("::1", 26379)],
                "animal-store",
                0,
                None,
                "pass@word",
            ),
        ),
        (
            "redis+sentinel://store:secret@db1:26379/animal-store/2",
            SentinelURI([("db1", 26379)], "animal-store", 2, "store", "secret"),
        ),
        (
            "redis+sentinel://db1:26379/animal-store",
            SentinelURI([("db1", 26379)], "animal-store", 0, None, None),
        ),
    ],
)
def test_a_sentinel_url_is_read_as_limits_spells_it(uri, read):
    assert parse_sentinel_uri(uri) == read
