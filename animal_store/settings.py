"""Where settings come from: package defaults, the deployment's file, then the environment."""

import os
from pathlib import Path

from sqlalchemy.engine import make_url

# config/ beside the package, in the checkout that gunicorn runs from.
CONFIG_DIR = Path(__file__).resolve().parent.parent / "config"


def load_settings(app, test_config=None) -> None:
    """Fill app.config; a deployment whose secrets are missing stops here, at boot."""
    app.config.from_object("animal_store.default_settings")
    if test_config is not None:
        app.config.from_mapping(test_config)
        source = "the settings given to create_app"
    else:
        load_deployment_settings(app)
        source = database_source(app)
    # For the command line to say where its database came from (database.py).
    app.extensions["animal_store_database_source"] = source
    refuse_renamed_settings(app)
    app.config["SQLALCHEMY_DATABASE_URI"] = database_uri(app)
    app.config["SQLALCHEMY_ENGINE_OPTIONS"] = engine_options(app)


def load_deployment_settings(app) -> None:
    environment = os.environ.get("ANIMAL_STORE_ENV")
    if environment:
        settings_file = CONFIG_DIR / f"{environment}.py"
        if not settings_file.is_file():
            raise RuntimeError(f"ANIMAL_STORE_ENV={environment!r} has no file {settings_file}.")
        try:
            app.config.from_pyfile(settings_file)
        except KeyError as missing:
            raise RuntimeError(
                f"ANIMAL_STORE_ENV={environment!r} needs {missing} in the environment."
            ) from None
    elif "DATABASE_URL" in os.environ:
        app.config["DATABASE_URL"] = os.environ["DATABASE_URL"]
    # Any other setting: ANIMAL_STORE_<NAME>, its value read as JSON where it parses.
    app.config.from_prefixed_env("ANIMAL_STORE")


def database_source(app) -> str:
    """Say where DATABASE_URL came from: the environment, a settings file or the default."""
    environment = os.environ.get("ANIMAL_STORE_ENV")
    settings_file = f"config/{environment}.py, as ANIMAL_STORE_ENV={environment}"
    if "ANIMAL_STORE_DATABASE_URL" in os.environ:
        return "ANIMAL_STORE_DATABASE_URL from the environment"
    if not app.config["DATABASE_URL"]:
        if environment:
            return f"the development default: {settings_file}, sets no DATABASE_URL"
        return "the development default: neither ANIMAL_STORE_ENV nor DATABASE_URL is set"
    if app.config["DATABASE_URL"] == os.environ.get("DATABASE_URL"):
        if environment:
            return f"DATABASE_URL from the environment, through {settings_file}"
        return "DATABASE_URL from the environment; ANIMAL_STORE_ENV is unset"
    return settings_file


# Settings renamed to the RATELIMIT_* names (Flask-Limiter's, kept). An old name stops the boot
# rather than being ignored, which would silently count in each worker's memory again.
RENAMED_SETTINGS = {
    "RATE_LIMIT_ENABLED": "RATELIMIT_ENABLED",
    "RATE_LIMIT_STORAGE_URI": "RATELIMIT_STORAGE_URI",
}


def refuse_renamed_settings(app) -> None:
    for old, new in RENAMED_SETTINGS.items():
        if old in app.config:
            raise RuntimeError(f"The setting {old} is now {new} (ANIMAL_STORE_{new}).")


def database_uri(app) -> str:
    url = app.config["DATABASE_URL"]
    if not url:
        os.makedirs(app.instance_path, exist_ok=True)
        return "sqlite:///" + os.path.join(app.instance_path, app.config["SQLITE_FILENAME"])
    parsed = make_url(url)
    # A plain postgresql:// (or Heroku-style postgres://) URL means psycopg 3, our driver.
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    return parsed.render_as_string(hide_password=False)


def engine_options(app) -> dict:
    """Add PostgreSQL's time limits, so an unreachable or stuck database means a quick 503
    (with the request's deadline, deadlines.py)."""
    options = dict(app.config["SQLALCHEMY_ENGINE_OPTIONS"])
    if not app.config["SQLALCHEMY_DATABASE_URI"].startswith("postgresql"):
        return options
    options.setdefault("pool_timeout", app.config["DATABASE_POOL_TIMEOUT"])
    # SQLAlchemy pings before any pool event, where no deadline reaches: deadlines.py pings on
    # checkout instead, once the connection is watched.
    options["pool_pre_ping"] = False
    connect_args = dict(options.get("connect_args", {}))
    connect_args.setdefault("connect_timeout", app.config["DATABASE_CONNECT_TIMEOUT"])
    if app.config["DATABASE_BEHIND_PGBOUNCER"]:
        connect_args.setdefault("prepare_threshold", None)
    else:
        statement_timeout_ms = int(app.config["DATABASE_STATEMENT_TIMEOUT"] * 1000)
        connect_args.setdefault("options", f"-c statement_timeout={statement_timeout_ms}")
    options["connect_args"] = connect_args
    return options
