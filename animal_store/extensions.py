"""Extension objects, created unbound and bound to an app in create_app."""

from flask import Flask
from flask_migrate import Migrate
from flask_sqlalchemy import SQLAlchemy
from sqlalchemy import event
from sqlalchemy.engine.interfaces import DBAPIConnection
from sqlalchemy.orm import DeclarativeBase
from sqlalchemy.pool import ConnectionPoolEntry

from animal_store.settings_schema import Settings


class Base(DeclarativeBase):
    pass


db = SQLAlchemy(model_class=Base)
migrate = Migrate()


def settings(app: Flask) -> "Settings":
    """Return the app's settings as checked at boot (settings.py), each with its type."""
    checked: Settings = app.extensions["animal_store_settings"]
    return checked


def tune_sqlite_connections(app: Flask) -> None:
    """Set up every new SQLite connection so several workers can write without 'locked' errors."""
    with app.app_context():
        engine = db.engine
    if engine.dialect.name != "sqlite":
        return
    busy_timeout_ms = int(settings(app).SQLITE_BUSY_TIMEOUT * 1000)
    pragmas = (
        # Readers never block the writer and the writer never blocks readers.
        "PRAGMA journal_mode=WAL",
        # Wait for the writer ahead instead of failing at once with "database is locked".
        f"PRAGMA busy_timeout={busy_timeout_ms}",
        "PRAGMA foreign_keys=ON",
        # FULL: a committed animal survives a power loss, not only a process crash
        # (docs/operations.rst, Durability).
        "PRAGMA synchronous=FULL",
    )

    @event.listens_for(engine, "connect")
    def apply_pragmas(
        dbapi_connection: DBAPIConnection, _connection_record: ConnectionPoolEntry
    ) -> None:
        cursor = dbapi_connection.cursor()
        for pragma in pragmas:
            cursor.execute(pragma)
        cursor.close()
