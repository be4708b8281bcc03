"""API keys an operator can scope, expire and rotate from the command line: a key without the
scope an operation needs gets 403, an expired key 401 like a revoked one, and a rotated key's
old secret works until its grace ends."""

import time
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa
from declared import PROTECTED

from animal_store.access.auth import SCOPES
from animal_store.data.models import ApiKey
from animal_store.extensions import db

NEW_PET = {"name": "Rex", "categoryId": 1}


def create_key(runner, name, *options):
    result = runner.invoke(args=["keys", "create", name, *options])
    assert result.exit_code == 0, result.output
    return result.output.strip().splitlines()[-1]


def bearer(key):
    return {"Authorization": f"Bearer {key}"}


@pytest.mark.parametrize("operation", PROTECTED, ids=str)
def test_a_key_without_the_scope_the_document_names_is_forbidden(
    client, runner, row_counts, operation
):
    # The scope comes from the served document (tests/test_openapi.py says which it must be).
    others = [scope for scope in SCOPES if scope != operation.scope]
    key = create_key(runner, "scoped", "--scopes", ",".join(others))
    before = row_counts()
    response = client.open(
        operation.url, method=operation.method, headers=bearer(key), json=NEW_PET
    )
    assert response.get_json() == {
        "code": "forbidden",
        "message": f"This API key may not {operation.method} {operation.url}: it lacks the "
        f"'{operation.scope}' scope.",
        "status": 403,
    }
    assert row_counts() == before  # refused before anything was done


@pytest.mark.parametrize("operation", PROTECTED, ids=str)
@pytest.mark.parametrize("scopes", ["only its own", "all"])
def test_a_key_with_the_scope_the_document_names_is_let_through(client, runner, operation, scopes):
    named = operation.scope if scopes == "only its own" else ",".join(SCOPES)
    key = create_key(runner, "scoped", "--scopes", named)
    response = client.open(
        operation.url, method=operation.method, headers=bearer(key), json=NEW_PET
    )
    assert response.status_code not in (401, 403), response.get_json()


def test_a_reading_key_reads_and_a_writing_key_writes(client, runner, make_pet, count_pets):
    make_pet()
    reader = bearer(create_key(runner, "reader", "--scopes", "read"))
    writer = bearer(create_key(runner, "writer", "--scopes", "write"))
    assert client.get("/v1/pets", headers=reader).status_code == 200
    assert client.get("/v1/pets/1", headers=reader).status_code == 200
    assert client.post("/v1/pets", json=NEW_PET, headers=writer).status_code == 201
    assert count_pets() == 2


def test_keys_made_before_scopes_keep_full_access(app, client, make_key, count_pets):
    # make_key stores a key without naming scopes, as every key before migration 0004 was.
    headers = bearer(make_key())
    with app.app_context():
        assert db.session.scalar(sa.select(ApiKey.scopes)) == "read,write"
    assert client.post("/v1/pets", json=NEW_PET, headers=headers).status_code == 201
    assert client.get("/v1/pets", headers=headers).status_code == 200


def test_an_expired_key_is_refused_like_a_revoked_one_even_from_the_cache(client, runner):
    expires = datetime.now(UTC) + timedelta(seconds=2)
    key = create_key(runner, "short-lived", "--expires", expires.isoformat())
    # Cached by this first request; the cache (KEY_CACHE_SECONDS, 5 s) outlives the key.
    assert client.get("/v1/pets", headers=bearer(key)).status_code == 200
    time.sleep(max(0.0, (expires - datetime.now(UTC)).total_seconds()) + 0.1)
    response = client.get("/v1/pets", headers=bearer(key))
    assert response.status_code == 401
    assert response.get_json()["code"] == "unauthorized"
    assert (
        response.headers["WWW-Authenticate"] == 'Bearer realm="animal-store", error="invalid_token"'
    )
    assert "expired" in runner.invoke(args=["keys", "list"]).output


def test_rotation_gives_a_new_key_and_the_old_one_works_until_its_grace_ends(make_app, count_pets):
    app = make_app(KEY_CACHE_SECONDS=0)
    client, runner = app.test_client(), app.test_cli_runner()
    old = create_key(runner, "shop", "--scopes", "read", "--rate-limit", "7/minute")
    rotated = runner.invoke(args=["keys", "rotate", "shop", "--grace", "2s"])
    assert rotated.exit_code == 0, rotated.output
    new = rotated.output.strip().splitlines()[-1]
    assert new != old
    assert new.startswith("ask_")
    assert f"replaces {old[:10]}..." in rotated.output
    listed = runner.invoke(args=["keys", "list"]).output
    assert f"active; old key {old[:10]}... until" in listed
    for key in (old, new):
        response = client.get("/v1/pets", headers=bearer(key))
        assert response.status_code == 200
        assert response.headers["RateLimit-Limit"] == "7"  # the same limit
        assert client.post("/v1/pets", json=NEW_PET, headers=bearer(key)).status_code == 403
    time.sleep(2.1)
    assert client.get("/v1/pets", headers=bearer(old)).status_code == 401
    assert client.get("/v1/pets", headers=bearer(new)).status_code == 200
    assert runner.invoke(args=["keys", "list"]).stdout.splitlines()[1].endswith("active")
    assert count_pets() == 0


def test_a_second_rotation_ends_the_first_old_key_at_once(make_app):
    app = make_app(KEY_CACHE_SECONDS=0)
    client, runner = app.test_client(), app.test_cli_runner()
    first = create_key(runner, "shop")
    runner.invoke(args=["keys", "rotate", "shop", "--grace", "1h"])
    third = runner.invoke(args=["keys", "rotate", "shop", "--grace", "1h"]).output.split()[-1]
    assert client.get("/v1/pets", headers=bearer(first)).status_code == 401
    assert client.get("/v1/pets", headers=bearer(third)).status_code == 200


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["keys", "create", "k", "--scopes", "admin"], "give one or both of read, write"),
        (["keys", "create", "k", "--scopes", ""], "give one or both of read, write"),
        (["keys", "create", "k", "--scopes", "read,,write"], "give one or both of read, write"),
        (["keys", "create", "k", "--expires", "2020-01-01T00:00:00Z"], "already past"),
        (["keys", "create", "k", "--expires", "2099-01-01T00:00:00"], "with its offset"),
        (["keys", "create", "k", "--expires", "next year"], "with its offset"),
        (["keys", "rotate", "existing", "--grace", "1 week"], "a number and a unit"),
        (["keys", "rotate", "existing", "--grace", "-1h"], "a number and a unit"),
        (["keys", "rotate", "nobody"], "No key named 'nobody'"),
        (["keys", "rotate", "revoked"], "is revoked: create a new one"),
    ],
)
def test_bad_key_commands_are_refused_and_change_nothing(runner, args, says):
    existing = create_key(runner, "existing")
    create_key(runner, "revoked")
    runner.invoke(args=["keys", "revoke", "revoked"])
    before = runner.invoke(args=["keys", "list"]).output
    result = runner.invoke(args=args)
    assert result.exit_code != 0
    assert says in result.output
    assert runner.invoke(args=["keys", "list"]).output == before
    assert existing not in before
