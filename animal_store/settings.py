"""Where settings come from: package defaults, the deployment's file, then the environment; and
the check, at boot, of what they add up to against their declarations (settings_schema.py)."""

import copy
import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import click
from flask import Config, Flask
from marshmallow import fields
from sqlalchemy.engine import URL

from animal_store import settings_schema
from animal_store.extensions import settings

# config/ beside the package, in the checkout that gunicorn runs from.
CONFIG_DIR = Path(__file__).resolve().parent.parent / "config"
ENVIRONMENT_PREFIX = "ANIMAL_STORE_"
# ANIMAL_STORE_* variables that are not settings: the deployment's name, read below, and
# gunicorn's address and its metrics' address, read and checked by config/gunicorn.conf.py.
NOT_SETTINGS = {"ENV", "BIND", "METRICS_BIND"}
# Where each setting given comes from: a file (or create_app's argument), or an environment
# variable and its text.
Sources = dict[str, tuple[str, str | None]]
DEFAULTS = "animal_store/default_settings.py"
DECLARED = settings_schema.SETTING_FIELDS
# Settings whose environment variable must hold JSON: a typo there is worth saying so.
STRUCTURED = (fields.List, fields.Dict, fields.Nested)
# A password in a URL's query, as libpq reads one: ?password=... or sslpassword=...
QUERY_PASSWORD = re.compile(r"([?&](?:ssl)?password=)[^&]*", re.IGNORECASE)


class SettingsError(click.ClickException):
    """A setting that stops the boot, said in one line. A ClickException, so that `flask` prints
    just its message, as it does its own errors, rather than a traceback; under gunicorn the
    master checks the settings before any worker boots (config/gunicorn.conf.py)."""


def load_settings(app: Flask, test_config: Mapping[str, Any] | None = None) -> None:
    """Fill app.config and check it; a missing secret or a bad value stops here, at boot."""
    app.config.from_object("animal_store.default_settings")
    # A copy of the defaults for each app: ANIMAL_STORE_<NAME>__<KEY> changes an object in place.
    app.config.update(copy.deepcopy({name: app.config[name] for name in DECLARED}))
    if test_config is not None:
        app.config.from_mapping(test_config)
        sources: Sources = dict.fromkeys(test_config, ("test_config", None))
        source = "the settings given to create_app"
    else:
        sources = load_deployment_settings(app)
        source = database_source(app)
    # For the command line to say where its database came from (database.py).
    app.extensions["animal_store_database_source"] = source
    app.extensions["animal_store_settings"] = check_settings(app.config, sources)
    app.config["SQLALCHEMY_DATABASE_URI"] = database_uri(app)
    app.config["SQLALCHEMY_ENGINE_OPTIONS"] = engine_options(app)


def check_environment() -> Config:
    """Load and check the settings as create_app() does, without making the app (gunicorn's
    master, before any worker starts), and return them."""
    app = Flask(__package__, instance_relative_config=True)
    load_settings(app)
    return app.config


def load_deployment_settings(app: Flask) -> Sources:
    """Load the deployment's file and the environment; return where each setting they set comes
    from (a file, or a variable and its text)."""
    sources: Sources = {}
    environment = os.environ.get("ANIMAL_STORE_ENV")
    if environment:
        settings_file = CONFIG_DIR / f"{environment}.py"
        if not settings_file.is_file():
            raise SettingsError(f"ANIMAL_STORE_ENV={environment!r} has no file {settings_file}.")
        from_file = Config(app.root_path)
        try:
            from_file.from_pyfile(settings_file)
        except KeyError as missing:
            raise SettingsError(
                f"ANIMAL_STORE_ENV={environment!r} needs {missing} in the environment."
            ) from None
        app.config.update(from_file)
        sources.update(dict.fromkeys(from_file, (f"config/{environment}.py", None)))
        if from_file.get("DATABASE_URL") == os.environ.get("DATABASE_URL"):
            sources["DATABASE_URL"] = ("DATABASE_URL", os.environ["DATABASE_URL"])
    elif "DATABASE_URL" in os.environ:
        app.config["DATABASE_URL"] = os.environ["DATABASE_URL"]
        sources["DATABASE_URL"] = ("DATABASE_URL", os.environ["DATABASE_URL"])
    # The standbys' URL is a secret as the primary's is, under a name of the same kind; a
    # deployment's file need not repeat it (ANIMAL_STORE_DATABASE_READ_URL, below, overrides it).
    if "DATABASE_READ_URL" in os.environ:
        app.config["DATABASE_READ_URL"] = os.environ["DATABASE_READ_URL"]
        sources["DATABASE_READ_URL"] = ("DATABASE_READ_URL", os.environ["DATABASE_READ_URL"])
    # Any other setting: ANIMAL_STORE_<NAME>, its value read as JSON where it parses (and
    # ANIMAL_STORE_<NAME>__<KEY> sets one key of a setting that is an object).
    for variable, text in sorted(os.environ.items()):
        name = variable.removeprefix(ENVIRONMENT_PREFIX).partition("__")[0]
        if variable.startswith(ENVIRONMENT_PREFIX) and name not in NOT_SETTINGS:
            sources[name] = (variable, text)
    app.config.from_prefixed_env(ENVIRONMENT_PREFIX.rstrip("_"))
    return sources


def database_source(app: Flask) -> str:
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


# Settings that are gone, and why: set, they stop the boot rather than seem to work.
REMOVED_SETTINGS = {
    "CORS_METHODS": "the methods browsers may use are those the /v1 routes allow, derived at boot",
}


def retired_settings(config: Config) -> list[str]:
    """Say each renamed or removed setting that is set, one line each."""
    return [
        f"The setting {old} is now {new} (ANIMAL_STORE_{new})."
        for old, new in RENAMED_SETTINGS.items()
        if old in config
    ] + [
        f"The setting {name} is gone: {why}. Remove it."
        for name, why in REMOVED_SETTINGS.items()
        if name in config
    ]


def check_settings(config: Config, sources: Sources) -> settings_schema.Settings:
    """Check every declared setting, and that each name set is a setting; write the values back
    as loaded (a date-time parsed from the environment's text) and return them typed. Every
    setting that is wrong is said, one line each, so one boot names them all."""
    retired = retired_settings(config)
    unknown = [
        f"{where if text is not None else name + ' in ' + where} names no setting "
        "(docs/configuration.rst lists them)."
        for name, (where, text) in sources.items()
        if name not in DECLARED
        and name not in Flask.default_config
        and name not in RENAMED_SETTINGS | REMOVED_SETTINGS
    ]
    loaded, problems = settings_schema.load(
        {name: config[name] for name in DECLARED if name in config}
    )
    said = (
        retired
        + unknown
        + [
            problem(name, config.get(name), sources.get(name, (DEFAULTS, None)))
            for name in problems
        ]
    )
    if not said:
        said = conflicts(loaded)
    if said:
        raise SettingsError("\n".join(said))
    config.update(loaded)
    return settings_schema.Settings(**loaded)


def conflicts(loaded: dict[str, Any]) -> list[str]:
    """Say each pair of settings, each fine alone, that cannot hold together, one line each."""
    if loaded.get("DATABASE_READ_URL") is None:
        return []
    said = []
    primary = loaded.get("DATABASE_URL")
    if primary is None or settings_schema.parse_database_url(primary).get_backend_name() not in (
        "postgresql",
        "postgres",
    ):
        said.append(
            "Setting DATABASE_READ_URL names standbys, which only a PostgreSQL DATABASE_URL has: "
            "unset it, or set DATABASE_URL to the primary's PostgreSQL URL."
        )
    return said


def problem(name: str, value: Any, source: tuple[str, str | None]) -> str:
    """Say a bad setting in one line: its name, its value as given (any password in it masked),
    what it must be."""
    where, text = source
    given = text if text is not None else value
    shown = repr(masked_url(given)) if isinstance(given, str) else masked_url(repr(given))
    origin = "" if where == name else f" from {where}"
    if name == "DATABASE_URL" and isinstance(given, str) and settings_schema.unencoded_at(given):
        return (
            f"Setting {name}{origin} is {shown}: its password holds an @, which a URL must give "
            "as %40 (percent-encode the whole password, docs/deploy.rst, step 3)."
        )
    note = ""
    field = DECLARED[name]
    if text is not None and isinstance(field, STRUCTURED) and not parses_as_json(text):
        note = " (the value is not valid JSON)"
    return f"Setting {name}{origin} is {shown}{note}: expected {settings_schema.expected(name)}."


def masked_url(url: str | URL) -> str:
    """Return a URL as any message may show it, its password ***: the one way the service shows
    a database URL (boot, commands, backups). A URL as given may not parse: whatever lies between
    "://user:" and the last "@" is the password then; a text without one is returned as it is."""
    if isinstance(url, URL):
        text = url.render_as_string(hide_password=True)
    else:
        scheme, separator, rest = url.partition("://")
        if not separator:
            scheme, rest = "", url
        credentials, at, location = rest.rpartition("@")
        user, colon, _ = credentials.partition(":")
        text = f"{scheme}{separator}{user}:***@{location}" if at and colon else url
    return QUERY_PASSWORD.sub(r"\1***", text)


def parses_as_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def database_uri(app: Flask) -> str:
    url = settings(app).DATABASE_URL
    if not url:
        os.makedirs(app.instance_path, exist_ok=True)
        return "sqlite:///" + os.path.join(app.instance_path, settings(app).SQLITE_FILENAME)
    return sqlalchemy_url(url)


def read_database_uri(app: Flask) -> str | None:
    """The standbys' URL as SQLAlchemy takes it, None without DATABASE_READ_URL."""
    url = settings(app).DATABASE_READ_URL
    return None if url is None else sqlalchemy_url(url)


def sqlalchemy_url(url: str) -> str:
    parsed = settings_schema.parse_database_url(url)
    # A plain postgresql:// (or Heroku-style postgres://) URL means psycopg 3, our driver.
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    return parsed.render_as_string(hide_password=False)


def engine_options(app: Flask) -> dict[str, Any]:
    """Add PostgreSQL's time limits, so an unreachable or stuck database means a quick 503
    (with the request's deadline, deadlines.py)."""
    config = settings(app)
    options = dict(config.SQLALCHEMY_ENGINE_OPTIONS)
    if not app.config["SQLALCHEMY_DATABASE_URI"].startswith("postgresql"):
        return options
    options.setdefault("pool_timeout", config.DATABASE_POOL_TIMEOUT)
    # SQLAlchemy pings before any pool event, where no deadline reaches: deadlines.py pings on
    # checkout instead, once the connection is watched.
    options["pool_pre_ping"] = False
    connect_args = dict(options.get("connect_args", {}))
    connect_args.setdefault("connect_timeout", config.DATABASE_CONNECT_TIMEOUT)
    if config.DATABASE_BEHIND_PGBOUNCER:
        connect_args.setdefault("prepare_threshold", None)
    else:
        statement_timeout_ms = int(config.DATABASE_STATEMENT_TIMEOUT * 1000)
        connect_args.setdefault("options", f"-c statement_timeout={statement_timeout_ms}")
    options["connect_args"] = connect_args
    return options
