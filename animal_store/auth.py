"""Bearer API keys: how they are made, stored (as hashes only) and checked on each request."""

import hashlib
import secrets
from datetime import UTC, datetime, timedelta

from flask import current_app, g, request

from animal_store.errors import APIError
from animal_store.extensions import db
from animal_store.models import ApiKey

# A recognisable prefix lets people and secret scanners spot a leaked key.
KEY_PREFIX = "ask_"
VISIBLE_PREFIX_LENGTH = len(KEY_PREFIX) + 6
REALM = 'Bearer realm="animal-store"'


def new_key() -> str:
    """Return a fresh key: the prefix and 256 random bits, URL-safe."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def hash_key(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def issue_key(name: str) -> tuple[ApiKey, str]:
    """Store a new key under this name and return it with the key, which is never stored."""
    key = new_key()
    api_key = ApiKey(
        name=name,
        prefix=key[:VISIBLE_PREFIX_LENGTH],
        key_hash=hash_key(key),
        created_at=datetime.now(UTC),
    )
    db.session.add(api_key)
    return api_key, key


def presented_key() -> str | None:
    """Return the key from `Authorization: Bearer <key>`; the scheme is case-insensitive."""
    scheme, _, credentials = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer":
        return None
    return credentials.strip() or None


def authenticate():
    """Let the request through only with a valid, unrevoked key; runs before everything else."""
    key = presented_key()
    if key is None:
        raise APIError(
            401,
            "unauthorized",
            "Send an API key as 'Authorization: Bearer <key>'.",
            headers={"WWW-Authenticate": REALM},
        )
    api_key = db.session.scalar(
        db.select(ApiKey).where(ApiKey.key_hash == hash_key(key), ApiKey.revoked_at.is_(None))
    )
    if api_key is None:
        raise APIError(
            401,
            "unauthorized",
            "The API key is not valid or has been revoked.",
            headers={"WWW-Authenticate": f'{REALM}, error="invalid_token"'},
        )
    g.api_key_name = api_key.name
    record_use(api_key)


def record_use(api_key: ApiKey) -> None:
    # Written at most once per resolution window, so reads do not each cost a write.
    now = datetime.now(UTC)
    resolution = timedelta(seconds=current_app.config["KEY_LAST_USED_RESOLUTION"])
    if api_key.last_used_at is None or now - api_key.last_used_at >= resolution:
        api_key.last_used_at = now
        db.session.commit()
