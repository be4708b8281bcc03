"""Idempotency-Key on POST /v1/pets: retries replay, reuse and races never create twice."""

import hashlib
import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta

import orjson
import pytest
import requests
import sqlalchemy as sa

from animal_store.data.models import ApiKey, IdempotencyRecord
from animal_store.extensions import db
from animal_store.idempotency import request_fingerprint, target_hash

REX = {"name": "Rex", "categoryId": 1, "status": "available"}


@pytest.fixture
def app(make_app):
    # The opportunistic purge is random (1% of keyed requests): off, unless a test turns it on.
    return make_app(IDEMPOTENCY_PURGE_CHANCE=0)


@pytest.fixture
def post(client, auth):
    def post_pet(key=None, body=REX, data=None, headers=None):
        headers = auth | ({"Idempotency-Key": key} if key is not None else {}) | (headers or {})
        if data is not None:
            headers["Content-Type"] = "application/json"
            return client.post("/v1/pets", data=data, headers=headers)
        return client.post("/v1/pets", json=body, headers=headers)

    return post_pet


@pytest.fixture
def records(app):
    """Run a statement on the idempotency records (None: list them) in the test's database."""

    def run(statement=None):
        with app.app_context():
            if statement is None:
                return list(db.session.scalars(sa.select(IdempotencyRecord)))
            db.session.execute(statement)
            db.session.commit()
            return None

    return run


@pytest.fixture
def claim_in_flight(app, records):
    """Store the claim a request with this key and body holds while it runs, `age` seconds old."""

    def claim(key, body, age=0):
        claimed_at = datetime.now(UTC) - timedelta(seconds=age)
        with app.app_context():
            api_key_id = db.session.scalar(sa.select(ApiKey.id))
        records(
            sa.insert(IdempotencyRecord).values(
                api_key_id=api_key_id,
                target_hash=target_hash("POST", "/v1/pets"),
                key=key,
                fingerprint=hashlib.sha256(
                    orjson.dumps(body, option=orjson.OPT_SORT_KEYS)
                ).digest(),
                claim="0" * 32,
                claimed_at=claimed_at,
                expires_at=claimed_at + timedelta(days=1),
            )
        )

    return claim


def test_retry_replays_the_first_answer(post, count_pets):
    first = post("order-1")
    again = post("order-1")
    assert first.status_code == again.status_code == 201
    assert again.get_json() == first.get_json()
    assert again.headers["Location"] == first.headers["Location"]
    assert again.headers["Content-Type"] == "application/json"
    assert again.headers["Idempotent-Replayed"] == "true"
    assert "Idempotent-Replayed" not in first.headers
    assert count_pets() == 1


@pytest.mark.parametrize(
    "data",
    [
        b'{"status": "available", "categoryId": 1, "name": "Rex"}',
        b'{ "name" : "R\\u0065x",\n "categoryId": 1, "status": "available" }',
    ],
)
def test_same_parsed_body_written_differently_replays(post, count_pets, data):
    first = post("order-1")
    again = post("order-1", data=data)
    assert again.status_code == 201
    assert again.get_json() == first.get_json()
    assert count_pets() == 1


def test_a_body_naming_a_member_twice_is_refused_not_replayed(post, count_pets):
    # Read as its last value it is the first body; whatever reads the first value judged another.
    post("order-1")
    again = post(
        "order-1", data=b'{"name": "Max", "name": "Rex", "categoryId": 1, "status": "available"}'
    )
    assert again.status_code == 400
    assert again.get_json()["code"] == "invalid_json"
    assert "Idempotent-Replayed" not in again.headers
    assert count_pets() == 1


def test_a_body_naming_a_member_twice_has_a_fingerprint_of_its_own(app):
    # createPet reads its body before it claims the key; a view that claimed first must still not
    # take such a body for the body of its last value.
    fingerprints = set()
    for data in (b'{"name": "Max", "name": "Rex"}', b'{"name": "Rex"}'):
        with app.test_request_context(
            "/v1/pets", method="POST", data=data, content_type="application/json"
        ):
            fingerprints.add(request_fingerprint())
    assert len(fingerprints) == 2


@pytest.mark.parametrize("quoted", ['"order-1"', ' "order-1" ', "order-1 "])
def test_quoted_and_bare_key_are_one_key(post, count_pets, quoted):
    first = post("order-1")
    again = post(quoted)
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.get_json() == first.get_json()
    assert count_pets() == 1


@pytest.mark.parametrize(
    "body", [REX | {"name": "Max"}, REX | {"categoryId": 2}, {"name": "Rex", "categoryId": 1}]
)
def test_same_key_with_another_body_is_422(post, count_pets, body):
    post("order-1")
    response = post("order-1", body=body)
    assert response.status_code == 422
    assert response.get_json() == {
        "code": "idempotency_key_reused",
        "message": "This Idempotency-Key was used with a different request body; use a new key.",
        "status": 422,
    }
    assert count_pets() == 1


def test_keys_are_scoped_to_the_api_key(client, post, make_key, count_pets):
    post("order-1")
    other = {"Authorization": f"Bearer {make_key('other')}", "Idempotency-Key": "order-1"}
    response = client.post("/v1/pets", json=REX, headers=other)
    assert response.status_code == 201
    assert "Idempotent-Replayed" not in response.headers
    assert count_pets() == 2


def test_different_keys_create_different_animals(post, count_pets):
    assert post("order-1").get_json()["id"] != post("order-2").get_json()["id"]
    assert count_pets() == 2


def test_without_the_header_nothing_is_remembered(post, records, count_pets):
    assert post().status_code == post().status_code == 201
    assert count_pets() == 2
    assert records() == []


@pytest.mark.parametrize(
    "key",
    [
        "",
        '""',
        "   ",
        "a" * 256,
        '"' + "a" * 256 + '"',
        '"unterminated',
        'in"side',
        '"bad \\n escape"',
        "tab\there",
        "caf\u00e9",
        "del\x7f",
        "two words",
    ],
)
def test_malformed_key_is_400(post, records, count_pets, key):
    response = post(key)
    assert response.status_code == 400
    body = response.get_json()
    assert body["code"] == "validation_error"
    assert list(body["errors"]) == ["Idempotency-Key"]
    assert count_pets() == 0
    assert records() == []


@pytest.mark.parametrize(
    "key", ["a", "a" * 255, '"' + "b" * 255 + '"', '"with spaces"', '"esc\\"aped\\\\"', "8e03-978e"]
)
def test_well_formed_keys_are_accepted(post, count_pets, key):
    assert post(key).status_code == 201
    assert post(key).headers["Idempotent-Replayed"] == "true"
    assert count_pets() == 1


@pytest.mark.parametrize(
    ("data", "status"),
    [(b'{"name": "Rex"}', 400), (b"{not json", 400), (b'{"name": "", "categoryId": 1}', 400)],
)
def test_failed_request_releases_the_key_for_a_corrected_retry(
    post, records, count_pets, data, status
):
    assert post("order-1", data=data).status_code == status
    assert records() == []
    retry = post("order-1")
    assert retry.status_code == 201
    assert "Idempotent-Replayed" not in retry.headers
    assert count_pets() == 1


def test_wrong_media_type_releases_the_key(client, auth, records):
    response = client.post(
        "/v1/pets",
        data=orjson.dumps(REX),
        headers=auth | {"Idempotency-Key": "k", "Content-Type": "text/plain"},
    )
    assert response.status_code == 415
    assert records() == []


def test_request_in_flight_is_409_with_retry_after(post, claim_in_flight, count_pets):
    claim_in_flight("order-1", REX)
    response = post("order-1")
    assert response.status_code == 409
    assert response.headers["Retry-After"] == "1"
    assert response.get_json()["code"] == "idempotency_key_in_use"
    assert count_pets() == 0


def test_in_flight_with_another_body_is_422(post, claim_in_flight):
    claim_in_flight("order-1", REX | {"name": "Max"})
    assert post("order-1").status_code == 422


def test_claim_of_a_dead_worker_is_taken_over_after_the_lease(
    post, claim_in_flight, records, count_pets
):
    claim_in_flight("order-1", REX, age=61)
    response = post("order-1")
    assert response.status_code == 201
    assert "Idempotent-Replayed" not in response.headers
    assert post("order-1").headers["Idempotent-Replayed"] == "true"
    assert count_pets() == 1
    assert len(records()) == 1


def test_lease_follows_the_setting(make_app, auth, claim_in_flight):
    claim_in_flight("order-1", REX, age=61)
    client = make_app(IDEMPOTENCY_LEASE=120).test_client()
    response = client.post("/v1/pets", json=REX, headers=auth | {"Idempotency-Key": "order-1"})
    assert response.status_code == 409


def expire_all():
    past = datetime.now(UTC) - timedelta(seconds=1)
    return sa.update(IdempotencyRecord).values(expires_at=past)


def test_expired_key_starts_afresh(post, records, count_pets):
    post("order-1")
    records(expire_all())
    response = post("order-1", body=REX | {"name": "Max"})
    assert response.status_code == 201
    assert response.get_json()["name"] == "Max"
    assert count_pets() == 2


def test_keys_are_kept_for_the_configured_ttl(make_app, auth, records):
    client = make_app(IDEMPOTENCY_TTL=3600).test_client()
    client.post("/v1/pets", json=REX, headers=auth | {"Idempotency-Key": "k"})
    (record,) = records()
    assert record.expires_at - record.claimed_at == timedelta(hours=1)


def test_default_ttl_is_a_day(post, records):
    post("k")
    (record,) = records()
    assert record.expires_at - record.claimed_at == timedelta(days=1)


def test_purge_command_deletes_only_expired_keys(post, runner, records):
    post("old")
    records(expire_all())
    post("fresh")
    result = runner.invoke(args=["idempotency", "purge"])
    assert result.exit_code == 0
    assert result.stdout == "Purged 1 expired idempotency keys.\n"
    assert [record.key for record in records()] == ["fresh"]


@pytest.mark.parametrize(("probability", "left"), [(1.0, ["new"]), (0.0, ["old", "new"])])
def test_requests_with_a_key_purge_now_and_then(make_app, auth, records, probability, left):
    client = make_app(IDEMPOTENCY_PURGE_CHANCE=probability).test_client()
    client.post("/v1/pets", json=REX, headers=auth | {"Idempotency-Key": "old"})
    records(expire_all())
    client.post("/v1/pets", json=REX, headers=auth | {"Idempotency-Key": "new"})
    assert sorted(record.key for record in records()) == sorted(left)


@pytest.mark.parametrize("instances", [1, 2])
def test_racing_duplicates_create_one_animal_per_key(
    start_gunicorn, api_key, count_pets, instances
):
    servers = [start_gunicorn(workers=2) for _ in range(instances)]
    keys, copies = 6, 6
    start = threading.Barrier(keys * copies)

    def create(n):
        key = f"race-{n % keys}"
        start.wait()
        response = requests.post(
            f"{servers[n % instances].url}/v1/pets",
            json={"name": key, "categoryId": 1},
            headers={"Authorization": f"Bearer {api_key}", "Idempotency-Key": key},
            timeout=60,
        )
        return key, response.status_code, response.json()

    with ThreadPoolExecutor(keys * copies) as pool:
        answers = list(pool.map(create, range(keys * copies)))
    assert {status for _, status, _ in answers} <= {201, 409}
    created = {}
    for key, status, body in answers:
        if status == 201:
            assert created.setdefault(key, body) == body
    assert count_pets() == len(created) <= keys
    # Once the dust settles, a retry of every key replays the one animal it made.
    for key in (f"race-{n}" for n in range(keys)):
        retry = requests.post(
            f"{servers[0].url}/v1/pets",
            json={"name": key, "categoryId": 1},
            headers={"Authorization": f"Bearer {api_key}", "Idempotency-Key": key},
            timeout=60,
        )
        assert retry.status_code == 201
        if key in created:
            assert retry.json() == created[key]
    assert count_pets() == keys
