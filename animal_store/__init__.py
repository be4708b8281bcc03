"""Animal Store: an HTTP/JSON service for managing the animals a store offers."""

from pathlib import Path

from flask import Flask

from animal_store import health, pets
from animal_store.cli import register_commands
from animal_store.errors import register_error_handlers
from animal_store.extensions import db, migrate, tune_sqlite_connections
from animal_store.idempotency import init_idempotency
from animal_store.json_provider import OrjsonProvider
from animal_store.logs import configure_logging
from animal_store.openapi import register_openapi
from animal_store.rate_limits import init_rate_limits
from animal_store.request_id import init_request_ids
from animal_store.security_headers import register_security_headers
from animal_store.settings import load_settings

MIGRATIONS_DIR = str(Path(__file__).parent / "migrations")


def create_app(test_config=None):
    """Create and configure an instance of the animal store."""
    app = Flask(__name__, instance_relative_config=True)
    # //v1/pets is not /v1/pets: a path means exactly what it says, nothing is normalised.
    app.url_map.merge_slashes = False
    load_settings(app, test_config)
    init_request_ids(app)
    configure_logging(app)
    app.json = OrjsonProvider(app)
    db.init_app(app)
    tune_sqlite_connections(app)
    migrate.init_app(app, db, directory=MIGRATIONS_DIR)
    register_error_handlers(app)
    init_rate_limits(app)
    app.register_blueprint(pets.bp, url_prefix="/v1")
    app.register_blueprint(health.bp)
    register_openapi(app)
    register_commands(app)
    init_idempotency(app)
    register_security_headers(app)
    return app
