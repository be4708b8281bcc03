"""Where the settings come from, and a deployment that lacks its secrets refusing to start."""

import pytest
import sqlalchemy as sa

from animal_store import create_app
from animal_store.extensions import db


@pytest.fixture
def clean_environment(monkeypatch, tmp_path):
    for name in ("DATABASE_URL", "ANIMAL_STORE_ENV", "ANIMAL_STORE_MAX_CONTENT_LENGTH"):
        monkeypatch.delenv(name, raising=False)
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
    with pytest.raises(RuntimeError, match="needs 'DATABASE_URL'"):
        create_app()


@pytest.mark.parametrize("environment", ["production", "staging"])
def test_deployment_reads_its_settings_file(clean_environment, environment):
    clean_environment.setenv("ANIMAL_STORE_ENV", environment)
    clean_environment.setenv("DATABASE_URL", "postgresql://u@db/store")
    app = create_app()
    assert app.config["SQLALCHEMY_DATABASE_URI"] == "postgresql+psycopg://u@db/store"


def test_unknown_deployment_fails_at_boot(clean_environment):
    clean_environment.setenv("ANIMAL_STORE_ENV", "prod")
    with pytest.raises(RuntimeError, match="has no file"):
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
    with pytest.raises(RuntimeError, match=f"ANIMAL_STORE_{new}"):
        create_app()
