"""Animal Store: an HTTP/JSON service for managing the animals a store offers."""

from pathlib import Path

from flask import Flask

from animal_store import pets
from animal_store.cli import register_commands
from animal_store.errors import register_error_handlers
from animal_store.extensions import db, migrate, tune_sqlite_connections
from animal_store.json_provider import OrjsonProvider
from animal_store.openapi import register_openapi
from animal_store.settings import load_settings

MIGRATIONS_DIR = str(Path(__file__).parent / "migrations")


def create_app(test_config=None):
    """Create and configure an instance of the animal store."""
    app = Flask(__name__, instance_relative_config=True)
    load_settings(app, test_config)
    app.json = OrjsonProvider(app)
    db.init_app(app)
    tune_sqlite_connections(app)
    migrate.init_app(app, db, directory=MIGRATIONS_DIR)
    register_error_handlers(app)
    app.register_blueprint(pets.bp, url_prefix="/v1")
    register_openapi(app)
    register_commands(app)
    return app
