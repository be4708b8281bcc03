"""The command line, all registered here: `flask keys ...` for API keys, `flask quickstart` for a
first run, `flask version`, and the commands of the other modules."""

import re
from datetime import UTC, datetime, timedelta

import click
from flask import Flask, current_app
from flask.cli import AppGroup
from sqlalchemy.exc import IntegrityError

from animal_store import errors
from animal_store.access import rate_limits
from animal_store.access.auth import SCOPES, issue_key, rotate_key
from animal_store.commands.backup import backup_command, restore_command
from animal_store.commands.quickstart import quickstart
from animal_store.commands.seed import seed_command
from animal_store.data.database import uses_database
from animal_store.data.models import ApiKey
from animal_store.extensions import db, settings
from animal_store.idempotency.claims import purge_expired
from animal_store.openapi import print_openapi
from animal_store.version import VERSION

keys_cli = AppGroup("keys", help="Create, list, limit, rotate and revoke API keys.")
# What `keys set-limit` takes to give a key the service's RATE_LIMIT again.
DEFAULT_LIMIT = "default"
DURATION = re.compile(r"(\d+)([smhd])")
DURATION_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days"}


def rate_limit_option(
    context: click.Context, parameter: click.Parameter, value: str | None
) -> str | None:
    if value is None or value == DEFAULT_LIMIT:
        return None
    try:
        return rate_limits.check_limit(value)
    except ValueError as error:
        raise click.BadParameter(str(error), context, parameter) from None


def scopes_option(
    context: click.Context, parameter: click.Parameter, value: str
) -> tuple[str, ...]:
    scopes = tuple(dict.fromkeys(scope.strip() for scope in value.split(",")))
    if not scopes or not set(scopes) <= set(SCOPES):
        raise click.BadParameter(
            f"{value!r}: give one or both of {', '.join(SCOPES)}, comma-separated",
            context,
            parameter,
        )
    return scopes


def expires_option(
    context: click.Context, parameter: click.Parameter, value: str | None
) -> datetime | None:
    if value is None:
        return None
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        moment = None
    if moment is None or moment.tzinfo is None:
        raise click.BadParameter(
            f"{value!r}: give a date and time with its offset, such as 2027-06-30T00:00:00Z",
            context,
            parameter,
        )
    if moment <= datetime.now(UTC):
        raise click.BadParameter(f"{value!r} is already past", context, parameter)
    return moment.astimezone(UTC)


def grace_option(context: click.Context, parameter: click.Parameter, value: str) -> timedelta:
    match = DURATION.fullmatch(value.strip())
    if match is None:
        raise click.BadParameter(
            f"{value!r}: give a number and a unit, s, m, h or d, such as 24h", context, parameter
        )
    return timedelta(**{DURATION_UNITS[match[2]]: int(match[1])})


@keys_cli.command("create")
@click.argument("name")
@click.option(
    "--scopes",
    default=",".join(SCOPES),
    show_default=True,
    callback=scopes_option,
    help="What the key may do: read (list and get animals), write (create them).",
)
@click.option(
    "--expires",
    callback=expires_option,
    help="When the key stops working, such as 2027-06-30T00:00:00Z; without it, never.",
)
@click.option(
    "--rate-limit",
    callback=rate_limit_option,
    help="Requests this key may make, such as '100/second'; without it, RATE_LIMIT.",
)
@uses_database()
def create_key(
    name: str, scopes: tuple[str, ...], expires: datetime | None, rate_limit: str | None
) -> None:
    """Create an API key called NAME and print it; it is shown only this once."""
    if not 1 <= len(name) <= 100:
        raise click.BadParameter("must be 1 to 100 characters", param_hint="NAME")
    api_key, key = issue_key(name, rate_limit, scopes, expires)
    try:
        db.session.commit()
    except IntegrityError:
        raise click.ClickException(f"A key named {name!r} exists already.") from None
    click.echo(f"Created API key {name!r} ({api_key.prefix}...). Store it now: it is shown once.")
    click.echo(key)


@keys_cli.command("list")
@uses_database()
def list_keys() -> None:
    """Show every key's name, visible prefix, scopes, expiry, rate limit, times and state, never
    the key."""
    rows = [("NAME", "PREFIX", "SCOPES", "EXPIRES", "RATE LIMIT", "CREATED", "LAST USED", "STATE")]
    default_limit = f"{settings(current_app).RATE_LIMIT} (default)"
    now = datetime.now(UTC)
    for api_key in db.session.scalars(db.select(ApiKey).order_by(ApiKey.created_at, ApiKey.id)):
        rows.append(
            (
                api_key.name,
                api_key.prefix + "...",
                api_key.scopes,
                format_time(api_key.expires_at) if api_key.expires_at else "never",
                api_key.rate_limit or default_limit,
                format_time(api_key.created_at),
                format_time(api_key.last_used_at),
                key_state(api_key, now),
            )
        )
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    for row in rows:
        click.echo(
            "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        )


@keys_cli.command("set-limit")
@click.argument("name")
@click.argument("limit", callback=rate_limit_option)
@uses_database()
def set_key_limit(name: str, limit: str | None) -> None:
    """Give the key called NAME its own rate LIMIT ('100/second', '6000 per minute'), or
    'default' for RATE_LIMIT. Every worker applies it within KEY_CACHE_SECONDS."""
    api_key = find_named_key(name)
    api_key.rate_limit = limit
    db.session.commit()
    if limit:
        click.echo(f"API key {name!r} now has the rate limit {limit}.")
    else:
        default = settings(current_app).RATE_LIMIT
        click.echo(f"API key {name!r} now has the default rate limit, {default} (RATE_LIMIT).")


@keys_cli.command("rotate")
@click.argument("name")
@click.option(
    "--grace",
    default="24h",
    show_default=True,
    callback=grace_option,
    help="How long the old key keeps working: 30m, 24h, 7d; 0s ends it now.",
)
@uses_database()
def rotate(name: str, grace: timedelta) -> None:
    """Print a new key for the key called NAME, with its scopes, expiry and rate limit; the old
    key works until the grace ends (within KEY_CACHE_SECONDS in every worker)."""
    api_key = find_named_key(name)
    if api_key.revoked_at is not None:
        raise click.ClickException(f"The key {name!r} is revoked: create a new one.")
    key = rotate_key(api_key, grace)
    db.session.commit()
    click.echo(
        f"Rotated API key {name!r}: {api_key.prefix}... replaces {api_key.previous_prefix}..., "
        f"which works until {format_time(api_key.previous_key_expires_at)}. "
        "Store the new key now: it is shown once."
    )
    click.echo(key)


@keys_cli.command("revoke")
@click.argument("name")
@uses_database()
def revoke_key(name: str) -> None:
    """Revoke the key called NAME; requests with it are refused from then on."""
    api_key = find_named_key(name)
    if api_key.revoked_at is not None:
        raise click.ClickException(f"The key {name!r} was revoked already.")
    api_key.revoked_at = datetime.now(UTC)
    db.session.commit()
    click.echo(f"Revoked API key {name!r}.")


idempotency_cli = AppGroup("idempotency", help="Look after the stored Idempotency-Keys.")


@idempotency_cli.command("purge")
@uses_database()
def purge_idempotency_keys() -> None:
    """Delete the Idempotency-Keys older than IDEMPOTENCY_TTL."""
    click.echo(f"Purged {purge_expired()} expired idempotency keys.")


errors_cli = AppGroup("errors", help="Print the error catalogue for the docs and for nginx.")


@errors_cli.command("table")
def print_error_table() -> None:
    """Print the catalogue as docs/errors.rst's table."""
    click.echo(errors.rst_error_table())


@errors_cli.command("nginx")
def print_nginx_errors() -> None:
    """Print the error bodies nginx answers with, for config/nginx.conf."""
    click.echo(errors.nginx_error_locations(settings(current_app)))


@click.command("version")
def print_version() -> None:
    """Print the service's version. As each worker's "Worker ready" line says it, of the code
    on disk; `flask --version` prints Flask's."""
    click.echo(f"animal-store {VERSION}")


def find_named_key(name: str) -> ApiKey:
    api_key: ApiKey | None = db.session.scalar(db.select(ApiKey).where(ApiKey.name == name))
    if api_key is None:
        raise click.ClickException(f"No key named {name!r}.")
    return api_key


def key_state(api_key: ApiKey, now: datetime) -> str:
    if api_key.revoked_at is not None:
        return f"revoked {format_time(api_key.revoked_at)}"
    if api_key.expires_at is not None and api_key.expires_at <= now:
        return "expired"
    if api_key.previous_key_expires_at is not None and api_key.previous_key_expires_at > now:
        return (
            f"active; old key {api_key.previous_prefix}... "
            f"until {format_time(api_key.previous_key_expires_at)}"
        )
    return "active"


def format_time(moment: datetime | None) -> str:
    return moment.strftime("%Y-%m-%d %H:%M:%S UTC") if moment else "never"


def register_commands(app: Flask) -> None:
    app.cli.add_command(keys_cli)
    app.cli.add_command(quickstart)
    app.cli.add_command(seed_command)
    app.cli.add_command(backup_command)
    app.cli.add_command(restore_command)
    app.cli.add_command(idempotency_cli)
    app.cli.add_command(errors_cli)
    app.cli.add_command(print_version)
    # Over flask-smorest's `openapi` group: `flask openapi` prints the served document.
    app.cli.add_command(print_openapi)
