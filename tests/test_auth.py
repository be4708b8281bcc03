"""Bearer API keys: every operation needs a valid one, and authentication comes first."""

import hashlib
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa
from declared import PROTECTED

from animal_store.access import last_used as last_used_writer
from animal_store.access.auth import issue_key
from animal_store.data.models import ApiKey
from animal_store.extensions import db

REALM = 'Bearer realm="animal-store"'
INVALID = f'{REALM}, error="invalid_token"'


@pytest.mark.parametrize("operation", PROTECTED, ids=str)
@pytest.mark.parametrize(
    ("authorization", "challenge"),
    [
        (None, REALM),
        ("", REALM),
        ("Bearer", REALM),
        ("Bearer ", REALM),
        ("Basic dXNlcjpwYXNz", REALM),
        ("Token {key}", REALM),
        ("Bearer{key}", REALM),
        ("Bearer ask_wrong", INVALID),
        ("Bearer {key}x", INVALID),
        ("Bearer {key_upper}", INVALID),
    ],
)
def test_request_without_valid_key_returns_401(
    client, api_key, operation, authorization, challenge, row_counts
):
    headers = {}
    if authorization is not None:
        headers["Authorization"] = authorization.format(key=api_key, key_upper=api_key.upper())
    before = row_counts()
    response = client.open(
        operation.url,
        method=operation.method,
        headers=headers,
        json={"name": "Rex", "categoryId": 1},
    )
    assert response.status_code == 401
    assert response.get_json()["code"] == "unauthorized"
    assert response.get_json()["status"] == 401
    assert response.headers["WWW-Authenticate"] == challenge
    assert row_counts() == before


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER", "bEaReR"])
def test_scheme_name_is_case_insensitive(client, api_key, scheme):
    response = client.get("/v1/pets", headers={"Authorization": f"{scheme} {api_key}"})
    assert response.status_code == 200


@pytest.mark.parametrize(
    ("method", "path", "kwargs"),
    [
        ("POST", "/v1/pets", {"data": b"{not json", "content_type": "application/json"}),
        ("POST", "/v1/pets", {"json": {"name": ""}}),
        ("POST", "/v1/pets", {"data": b"x", "content_type": "text/plain"}),
        ("POST", "/v1/pets", {"data": b"x" * 70_000, "content_type": "application/json"}),
        ("GET", "/v1/pets/12345", {}),
        ("GET", "/v1/pets/abc", {}),
        ("GET", "/v1/pets?limit=1000", {}),
    ],
)
def test_authentication_runs_before_anything_else(client, method, path, kwargs):
    response = client.open(path, method=method, **kwargs)
    assert response.status_code == 401


def test_revoked_key_stops_working(make_app):
    # Without the key cache a revocation takes effect on the next request.
    app = make_app(KEY_CACHE_SECONDS=0)
    client, runner = app.test_client(), app.test_cli_runner()
    with app.app_context():
        _, api_key = issue_key("tester")
        db.session.commit()
    headers = {"Authorization": f"Bearer {api_key}"}
    assert client.get("/v1/pets", headers=headers).status_code == 200
    assert runner.invoke(args=["keys", "revoke", "tester"]).exit_code == 0
    response = client.get("/v1/pets", headers=headers)
    assert response.status_code == 401
    assert response.headers["WWW-Authenticate"] == INVALID


def test_keys_are_random_prefixed_and_stored_only_as_hash(app, make_key):
    keys = [make_key(f"k{n}") for n in range(5)]
    assert len(set(keys)) == 5
    for key in keys:
        assert key.startswith("ask_")
        # 256 bits of randomness in URL-safe base64 is 43 characters.
        assert len(key) - len("ask_") >= 43
    with app.app_context():
        rows = db.session.execute(sa.select(ApiKey.__table__)).mappings().all()
    stored = repr(rows)
    for key in keys:
        assert key not in stored
        assert key[len("ask_") :] not in stored
        assert hashlib.sha256(key.encode()).digest() in {row["key_hash"] for row in rows}


def test_last_used_is_recorded_at_most_once_a_minute(make_app):
    # Uncached, so the rewound time below is seen; tests/test_key_cache.py covers the cached path.
    app = make_app(KEY_CACHE_SECONDS=0)
    client = app.test_client()
    with app.app_context():
        _, api_key = issue_key("tester")
        db.session.commit()

    def last_used():
        assert last_used_writer.flush(timeout=10)
        with app.app_context():
            return db.session.scalar(sa.select(ApiKey.last_used_at))

    headers = {"Authorization": f"Bearer {api_key}"}
    assert last_used() is None
    client.get("/v1/pets", headers=headers)
    first = last_used()
    assert first is not None
    assert abs(datetime.now(UTC) - first) < timedelta(seconds=10)
    client.get("/v1/pets", headers=headers)
    assert last_used() == first
    with app.app_context():
        db.session.execute(sa.update(ApiKey).values(last_used_at=first - timedelta(minutes=2)))
        db.session.commit()
    client.get("/v1/pets", headers=headers)
    assert last_used() > first - timedelta(minutes=1)
