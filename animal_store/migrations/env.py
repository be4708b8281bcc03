"""Alembic environment: runs the migrations on the engine of the current Flask app."""

import logging
from logging.config import fileConfig

from alembic import context
from alembic.operations.ops import MigrationScript
from alembic.runtime.migration import MigrationContext
from flask import current_app, g
from flask_sqlalchemy import SQLAlchemy

from animal_store.data.database import connect, describe_database

config = context.config
# Keep the loggers the app (or the test run) configured before the migration started.
if config.config_file_name is not None:  # Flask-Migrate's alembic.ini, always there
    fileConfig(config.config_file_name, disable_existing_loggers=False)
logger = logging.getLogger("alembic.env")

db: SQLAlchemy = current_app.extensions["migrate"].db


def run_migrations_offline() -> None:
    """Print the SQL for the migrations instead of running it."""
    context.configure(
        # The URL itself: its password is never written out as text, into Alembic's config.
        url=db.engine.url,
        literal_binds=True,
        target_metadata=db.metadata,
        # As Alembic's own template: with the driver's "format" paramstyle a % in the SQL (as in
        # format('... %s', ...) of 0005's and 0008's functions) would be printed doubled.
        dialect_opts={"paramstyle": "named"},
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    def skip_empty_autogenerate(
        context_: MigrationContext, revision: object, directives: list[MigrationScript]
    ) -> None:
        # One database: its changes are in upgrade_ops (upgrade_ops_list is for several).
        changes = directives[0].upgrade_ops
        if (
            getattr(config.cmd_opts, "autogenerate", False)
            and changes is not None
            and changes.is_empty()
        ):
            directives[:] = []
            logger.info("No changes in schema detected.")

    conf_args = current_app.extensions["migrate"].configure_args
    conf_args.setdefault("process_revision_directives", skip_empty_autogenerate)
    # Which database `flask db ...` changes, and where that choice came from.
    if not g.get("database_said"):
        logger.info("Database: %s", describe_database())
    # A database it cannot use is refused in one line, as by every other command, and so is a
    # fault met while migrating: a full disk, a server that takes only reads (database.py).
    with connect() as connection:
        # Flask-Migrate's configure_args include render_as_batch, which SQLite needs for ALTERs.
        context.configure(connection=connection, target_metadata=db.metadata, **conf_args)
        with context.begin_transaction():
            context.run_migrations()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
