"""create_app: the app, put together from the package's modules (the table of contents).

Imported by the package on first use of create_app, not with it (animal_store/__init__.py).
"""

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from flask import Blueprint, Flask

from animal_store import openapi, pets
from animal_store.access import auth
from animal_store.api import declared_query_parameters, register_api
from animal_store.commands.cli import register_commands
from animal_store.data import answers, keyset
from animal_store.data.database_faults import init_database_faults
from animal_store.data.deadlines import init_deadlines
from animal_store.data.failover import init_failover
from animal_store.data.standbys import init_standbys
from animal_store.extensions import db, migrate, tune_sqlite_connections
from animal_store.hooks import AnimalStore, register_hooks
from animal_store.http.body import refuse_unsupported_framing
from animal_store.http.host import refuse_malformed_host
from animal_store.http.json_provider import OrjsonProvider
from animal_store.http.proxies import trust_proxies
from animal_store.http.request_id import add_request_id_header
from animal_store.http.security_headers import security_headers
from animal_store.http.shedding import init_shedding
from animal_store.observability import health
from animal_store.observability.logs import configure_logging, request_log, start_timer
from animal_store.observability.metrics import init_metrics
from animal_store.settings import load_settings

MIGRATIONS_DIR = str(Path(__file__).parent / "migrations")
# The blueprints served under /v1, each inheriting everything the API layer gives (api/).
RESOURCES = (pets.bp, openapi.bp)


def create_app(
    test_config: Mapping[str, Any] | None = None, resources: Iterable[Blueprint] = RESOURCES
) -> Flask:
    """Create and configure an instance of the animal store."""
    # The package's name, as Flask advises for a package: it names the app's logger and finds
    # the instance folder and the package's files.
    app = AnimalStore("animal_store", instance_relative_config=True)
    # //v1/pets is not /v1/pets: a path means exactly what it says, nothing is normalised.
    app.url_map.merge_slashes = False
    load_settings(app, test_config)
    configure_logging(app)
    app.json = OrjsonProvider(app)
    db.init_app(app)
    tune_sqlite_connections(app)
    init_database_faults(app)
    migrate.init_app(app, db, directory=MIGRATIONS_DIR)
    # A key, an answer or a settled id a worker kept is used only from the database server it
    # came from (a new memo of data goes here). Before the deadlines: its order of DATABASE_URL's
    # hosts must be set before their listener connects, and SQLAlchemy runs a dialect's
    # do_connect listeners in the order they were added (it ignores insert=True for them).
    confirm_database = init_failover(
        app, memos=(answers.KEPT, auth.KEY_CACHE, keyset.ANSWERS, keyset.POSITIONS)
    )
    start_deadline = init_deadlines(app)
    init_standbys(app)
    policies = register_api(app, resources, before=confirm_database)
    app.register_blueprint(health.bp)
    register_commands(app)
    trust_proxies(app)
    # Last: it labels requests by every route registered above.
    metrics = init_metrics(app)
    register_hooks(
        app,
        before=(
            start_timer,
            refuse_malformed_host,
            *init_shedding(app),
            *start_deadline,
            refuse_unsupported_framing,
        ),
        after=(
            metrics.observe,
            security_headers(private=policies.requires_key),
            add_request_id_header,
            # Only the values of the query parameters the document declares are logged: any
            # other may hold a key (?api_key=...).
            request_log(declared_query_parameters(app)),
        ),
    )
    return app
