"""Keyset pagination: walking the list by Link rel="next", cursors, and the seed command."""

import base64
import hashlib
import re
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import parse_qs, urlsplit

import pytest
import requests
import sqlalchemy as sa
from marshmallow import ValidationError

from animal_store.commands.seed import seed_pets
from animal_store.data.filters import LIST_FILTERS, walk_of
from animal_store.data.models import Pet
from animal_store.data.pagination import (
    CURSOR_TEXT,
    MAX_CURSOR_LENGTH,
    Position,
    decode_cursor,
    encode_cursor,
)
from animal_store.extensions import db
from animal_store.schemas import ListQuery, ListQuerySchema, RefusingNextReleaseFilters

NEXT_LINK = re.compile(r'<([^>]*)>; rel="next"')


def next_url(response):
    match = NEXT_LINK.fullmatch(response.headers.get("Link", ""))
    return match[1] if match else None


def walk(client, auth, url, between_pages=lambda: None):
    """Follow rel="next" from url to the last page; return every id seen, in order."""
    seen = []
    while url:
        response = client.get(url, headers=auth)
        assert response.status_code == 200
        seen += [pet["id"] for pet in response.get_json()]
        url = next_url(response)
        between_pages()
    return seen


@pytest.fixture
def seed(app):
    """Add sample animals (statuses cycle available, pending, sold, none); return all ids."""

    def seed_and_list(count):
        with app.app_context():
            seed_pets(count)
            return list(db.session.scalars(sa.select(Pet.id).order_by(Pet.id)))

    return seed_and_list


@pytest.fixture
def ids_with_status(app):
    def ids(status):
        with app.app_context():
            select = sa.select(Pet.id).order_by(Pet.id)
            if status is not None:
                select = select.where(Pet.status == status)
            return list(db.session.scalars(select))

    return ids


@pytest.mark.parametrize(("status", "limit"), [(None, 7), (None, 100), ("sold", 9), ("pending", 1)])
def test_walk_sees_every_animal_once_in_id_order(
    client, auth, seed, ids_with_status, status, limit
):
    seed(403)
    query = f"limit={limit}" + (f"&status={status}" if status else "")
    seen = walk(client, auth, f"/v1/pets?{query}")
    assert seen == ids_with_status(status)


@pytest.mark.parametrize("status", [None, "available"])
def test_walk_with_inserts_meanwhile_sees_each_earlier_animal_once(
    client, auth, seed, ids_with_status, status
):
    seed(250)
    before = ids_with_status(status)
    added = []

    def add_animals():
        for n in range(3):
            response = client.post(
                "/v1/pets",
                json={"name": f"late{n}", "categoryId": 1, "status": "available"},
                headers=auth,
            )
            added.append(response.get_json()["id"])

    query = "limit=10" + (f"&status={status}" if status else "")
    seen = walk(client, auth, f"/v1/pets?{query}", between_pages=add_animals)
    assert len(seen) == len(set(seen))
    assert seen == sorted(seen)
    assert [pet_id for pet_id in seen if pet_id not in added] == before
    assert len(added) >= 3 * len(before) // 10


def test_next_link_keeps_limit_and_status_as_an_absolute_url(client, auth, seed):
    seed(40)
    response = client.get("/v1/pets?status=sold&limit=3&color=brown", headers=auth)
    url = urlsplit(next_url(response))
    assert (url.scheme, url.netloc, url.path) == ("http", "localhost", "/v1/pets")
    query = parse_qs(url.query)
    assert query.keys() == {"limit", "status", "cursor"}
    assert (query["limit"], query["status"]) == (["3"], ["sold"])


def test_next_link_without_status_has_no_status(client, auth, seed):
    seed(21)
    query = parse_qs(urlsplit(next_url(client.get("/v1/pets", headers=auth))).query)
    assert query.keys() == {"limit", "cursor"}
    assert query["limit"] == ["20"]


@pytest.mark.parametrize(("count", "pages"), [(0, 1), (5, 1), (6, 2), (10, 2), (11, 3)])
def test_last_page_has_no_next_link(client, auth, seed, count, pages):
    seed(count)
    url, responses = "/v1/pets?limit=5", []
    while url:
        responses.append(client.get(url, headers=auth))
        url = next_url(responses[-1])
    assert len(responses) == pages
    assert "Link" not in responses[-1].headers
    assert all(len(response.get_json()) == 5 for response in responses[:-1])


def valid_cursor(client, auth, seed, query="limit=2"):
    seed(10)
    return parse_qs(urlsplit(next_url(client.get(f"/v1/pets?{query}", headers=auth))).query)[
        "cursor"
    ][0]


def forged(payload: bytes) -> str:
    """A cursor with a correct checksum around a payload this service never writes."""
    digest = hashlib.blake2b(payload, digest_size=8, person=b"animal-cursor").digest()
    return base64.urlsafe_b64encode(payload + digest).rstrip(b"=").decode()


@pytest.mark.parametrize(
    "tamper",
    [
        lambda cursor: "",
        lambda cursor: "abc",
        lambda cursor: "!!!!",
        lambda cursor: "%00",
        lambda cursor: "é",
        lambda cursor: "12",
        lambda cursor: cursor[:-1],
        lambda cursor: cursor[1:],
        lambda cursor: cursor + "A",
        lambda cursor: cursor + "=",
        lambda cursor: cursor.upper(),
        lambda cursor: cursor[:5] + ("B" if cursor[5] != "B" else "C") + cursor[6:],
        lambda cursor: cursor * 10,
        lambda cursor: base64.urlsafe_b64encode(b"1.3.").decode().rstrip("="),
        lambda cursor: forged(b"1.03."),
        lambda cursor: forged(b"1.-5."),
        lambda cursor: forged(b"1.9223372036854775808."),
        lambda cursor: forged(b"2.3."),
        lambda cursor: forged(b"1.3.lost"),
        lambda cursor: forged(b"1.3"),
        lambda cursor: forged(b"1.3.."),
        lambda cursor: forged(b"1.3.sold.sold.sold"),
        lambda cursor: forged(b"\xff\xfe"),
    ],
)
def test_garbled_or_tampered_cursor_is_400(client, auth, seed, tamper):
    cursor = tamper(valid_cursor(client, auth, seed))
    response = client.get("/v1/pets", query_string={"cursor": cursor}, headers=auth)
    assert response.status_code == 400
    body = response.get_json()
    assert body["code"] == "validation_error"
    assert list(body["errors"]) == ["cursor"]
    assert "cursor" in body["message"]


@pytest.mark.parametrize(
    ("made_with", "used_with"),
    [("", "&status=sold"), ("&status=sold", ""), ("&status=sold", "&status=pending")],
)
def test_cursor_from_another_status_filter_is_400(client, auth, seed, made_with, used_with):
    cursor = valid_cursor(client, auth, seed, "limit=1" + made_with)
    response = client.get(f"/v1/pets?cursor={cursor}{used_with}", headers=auth)
    assert response.status_code == 400
    assert list(response.get_json()["errors"]) == ["cursor"]


def test_forged_cursor_only_moves_the_position(client, auth, seed):
    ids = seed(10)
    cursor = encode_cursor(Position(ids[6], walk_of({})))
    response = client.get(f"/v1/pets?cursor={cursor}", headers=auth)
    assert [pet["id"] for pet in response.get_json()] == ids[7:]


# Cursors made by the release before the filters were declared (encode_cursor at 56a8717), as its
# clients hold them: each names the same position now and is made again byte for byte, so old and
# new workers take each other's cursors during a rollout.
RELEASED_CURSORS = [
    ("MS43Lp7tbKATsr92", 7, {}),
    ("MS40Mi5zb2xkBvipg-m7hqM", 42, {"status": "sold"}),
    ("MS45MjIzMzcyMDM2ODU0Nzc1ODA3LmF2YWlsYWJsZW8SFrvu0ra-", 2**63 - 1, {"status": "available"}),
]


@pytest.mark.parametrize(("cursor", "last_id", "filters"), RELEASED_CURSORS)
def test_a_cursor_of_the_release_before_names_the_same_position(cursor, last_id, filters):
    position = Position(last_id, walk_of(filters))
    assert decode_cursor(cursor) == position
    assert encode_cursor(position) == cursor


def test_a_cursor_of_the_release_before_walks_on(client, auth, seed):
    ids = seed(10)
    response = client.get("/v1/pets?cursor=MS43Lp7tbKATsr92", headers=auth)
    assert [pet["id"] for pet in response.get_json()] == [pet_id for pet_id in ids if pet_id > 7]


def test_the_longest_cursor_fits_the_cap_the_filters_give():
    longest = Position(
        2**63 - 1, tuple(max(list_filter.choices, key=len) for list_filter in LIST_FILTERS)
    )
    cursor = encode_cursor(longest)
    assert len(cursor) <= MAX_CURSOR_LENGTH
    assert CURSOR_TEXT.fullmatch(cursor)
    assert decode_cursor(cursor) == longest


def test_list_query_type_names_every_parameter():
    assert ListQuery.__required_keys__ | ListQuery.__optional_keys__ == set(
        ListQuerySchema().fields
    )


def test_limit_may_change_between_pages(client, auth, seed):
    ids = seed(10)
    cursor = parse_qs(urlsplit(next_url(client.get("/v1/pets?limit=3", headers=auth))).query)[
        "cursor"
    ][0]
    response = client.get(f"/v1/pets?limit=5&cursor={cursor}", headers=auth)
    assert [pet["id"] for pet in response.get_json()] == ids[3:8]


def test_bad_cursor_without_a_key_is_401(client):
    assert client.get("/v1/pets?cursor=garbage").status_code == 401


def test_status_walk_has_its_index(app):
    with app.app_context():
        indexes = db.inspect(db.engine).get_indexes("pets")
    assert {"name": "ix_pets_status_id", "column_names": ["status", "id"]} in [
        {"name": index["name"], "column_names": index["column_names"]} for index in indexes
    ]


def test_seed_command_adds_animals_with_every_status(runner, count_pets, ids_with_status):
    result = runner.invoke(args=["seed", "41"])
    assert result.exit_code == 0
    assert result.stdout == "Seeded 41 animals.\n"
    assert count_pets() == 41
    statuses = {status: len(ids_with_status(status)) for status in ("available", "pending", "sold")}
    assert statuses == {"available": 11, "pending": 10, "sold": 10}


@pytest.mark.parametrize("count", ["0", "-3", "many"])
def test_seed_command_refuses_a_bad_count(runner, count_pets, count):
    result = runner.invoke(args=["seed", count])
    assert result.exit_code != 0
    assert count_pets() == 0


def test_cursor_is_no_field_of_a_new_animal(client, auth, count_pets):
    body = {"name": "Rex", "categoryId": 1, "cursor": "MS4zLg"}
    response = client.post("/v1/pets", json=body, headers=auth)
    assert response.status_code == 400
    assert list(response.get_json()["errors"]) == ["cursor"]
    assert count_pets() == 0


def test_walk_sees_every_animal_acknowledged_before_its_last_page(
    app, make_pet, api_key, slow_insert, start_gunicorn
):
    """A creation commits late (its id taken first), another one is sent meanwhile, and a walk
    passes the end of the list between the two: every animal whose 201 came before the walk asked
    for its last page is in the walk. On PostgreSQL, without ids made visible in id order, the
    walk saw the quick ones' ids, then ended after the slow one's lower id had committed."""
    for name in ("Rex", "Kitty", "Polly"):
        make_pet(name=name)
    server = start_gunicorn(workers=3)
    auth = {"Authorization": f"Bearer {api_key}"}
    acknowledged = {}

    def create(*names):
        for name in names:
            response = requests.post(
                server.url + "/v1/pets",
                json={"name": name, "categoryId": 1, "status": "available"},
                headers=auth,
                timeout=30,
            )
            assert response.status_code == 201, response.text
            acknowledged[response.json()["id"]] = time.monotonic()

    seen, url = [], server.url + "/v1/pets?limit=2"
    with ThreadPoolExecutor(max_workers=2) as pool:
        # The first page; then the slow creation takes id 4 and two quick ones are sent.
        page = requests.get(url, headers=auth, timeout=30)
        seen += [pet["id"] for pet in page.json()]
        url = next_url(page)
        slow = pool.submit(create, "Slowpoke")
        time.sleep(0.5)
        quick = pool.submit(create, "Quick", "Quicker")
        time.sleep(0.5)
        while url:
            asked = time.monotonic()
            page = requests.get(url, headers=auth, timeout=30)
            seen += [pet["id"] for pet in page.json()]
            url = next_url(page)
            if url:
                # Not the last page yet: let both creations finish before the next one.
                slow.result(), quick.result()
        slow.result(), quick.result()

    assert seen == sorted(set(seen))
    assert {pet_id for pet_id, at in acknowledged.items() if at < asked} <= set(seen)
    assert sorted(acknowledged) == [4, 5, 6]


class NextReleaseQuerySchema(RefusingNextReleaseFilters):
    # listPets' query in a release whose next one serves a `tag` filter.
    next_release_filters = ("tag",)


@pytest.mark.parametrize("query", [{"tag": "x"}, {"limit": "5", "tag": ""}])
def test_a_filter_of_the_next_release_is_refused_not_ignored(query):
    with pytest.raises(ValidationError) as refused:
        NextReleaseQuerySchema().load(query)
    assert list(refused.value.messages) == ["tag"]


def test_an_unknown_parameter_is_still_ignored():
    assert NextReleaseQuerySchema().load({"limit": "5", "tags": "x"}) == {"limit": 5}
