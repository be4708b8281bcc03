"""The three operations as the contract describes them, with the decisions on its gaps."""

from datetime import UTC, datetime
from urllib.parse import urlsplit

import pytest


def test_create_pet_returns_201_with_body_and_location(client, auth, count_pets):
    response = client.post(
        "/v1/pets", json={"name": "Rex", "categoryId": 7, "status": "sold"}, headers=auth
    )
    assert response.status_code == 201
    assert response.content_type == "application/json"
    body = response.get_json()
    assert body == {"id": body["id"], "name": "Rex", "categoryId": 7, "status": "sold"}
    assert isinstance(body["id"], int)
    assert body["id"] > 0
    assert urlsplit(response.headers["Location"]).path == f"/v1/pets/{body['id']}"
    assert count_pets() == 1


def test_create_pet_without_status_leaves_the_field_out(client, auth):
    response = client.post("/v1/pets", json={"name": "Tom", "categoryId": 1}, headers=auth)
    assert response.status_code == 201
    assert "status" not in response.get_json()
    fetched = client.get(response.headers["Location"], headers=auth)
    assert "status" not in fetched.get_json()
    listed = client.get("/v1/pets", headers=auth)
    assert "status" not in listed.get_json()[0]


@pytest.mark.parametrize("category_id", [-(2**63), 0, 2**63 - 1])
def test_create_pet_accepts_the_int64_range(client, auth, category_id):
    response = client.post(
        "/v1/pets", json={"name": "Edge", "categoryId": category_id}, headers=auth
    )
    assert response.status_code == 201
    fetched = client.get(response.headers["Location"], headers=auth)
    assert fetched.get_json()["categoryId"] == category_id


@pytest.mark.parametrize("name", ["A", "a" * 255, "Rex the 2nd", "Ñandú 🐦", "  padded  "])
def test_create_pet_keeps_the_name_exactly(client, auth, name):
    response = client.post("/v1/pets", json={"name": name, "categoryId": 1}, headers=auth)
    assert response.status_code == 201
    fetched = client.get(response.headers["Location"], headers=auth)
    assert fetched.get_json()["name"] == name


def test_create_pet_accepts_a_charset_parameter(client, auth):
    response = client.post(
        "/v1/pets",
        data=b'{"name": "Rex", "categoryId": 1}',
        headers=auth | {"Content-Type": "Application/JSON; charset=UTF-8"},
    )
    assert response.status_code == 201


def test_get_pet_returns_the_animal(client, auth, make_pet):
    pet_id = make_pet(name="Kitty", category_id=3, status="pending")
    response = client.get(f"/v1/pets/{pet_id}", headers=auth)
    assert response.status_code == 200
    assert response.get_json() == {
        "id": pet_id,
        "name": "Kitty",
        "categoryId": 3,
        "status": "pending",
    }


@pytest.mark.parametrize("found", [True, False])
def test_get_pet_is_marked_deprecated(client, auth, make_pet, found):
    pet_id = make_pet() if found else 999
    response = client.get(f"/v1/pets/{pet_id}", headers=auth)
    assert response.status_code == (200 if found else 404)
    assert response.headers["Deprecation"] == "@1795305600"
    assert response.headers["Sunset"] == "Thu, 05 Dec 2030 00:00:00 GMT"
    assert response.headers["Link"] == '</v1/pets>; rel="successor-version"'


def test_deprecation_headers_follow_the_setting(make_app, api_key):
    app = make_app(
        GET_PET_DEPRECATION={
            "since": datetime(2027, 1, 1, tzinfo=UTC),
            "sunset": datetime(2031, 6, 1, tzinfo=UTC),
            "successor": "/v2/animals",
        }
    )
    response = app.test_client().get("/v1/pets/1", headers={"Authorization": f"Bearer {api_key}"})
    assert response.headers["Deprecation"] == "@1798761600"
    assert response.headers["Sunset"] == "Sun, 01 Jun 2031 00:00:00 GMT"
    assert response.headers["Link"] == '</v2/animals>; rel="successor-version"'


def test_get_pet_missing_returns_404(client, auth, make_pet):
    make_pet()
    response = client.get("/v1/pets/2", headers=auth)
    assert response.status_code == 404
    assert response.get_json() == {
        "code": "not_found",
        "message": "No animal with id 2.",
        "status": 404,
    }


@pytest.mark.parametrize(
    "pet_id",
    [
        "abc",
        "0",
        "00",
        # One animal, one URL: /v1/pets/1 only, never its id with leading zeros.
        "01",
        "001",
        "0" * 18 + "1",
        "-1",
        "1.0",
        "1e3",
        "+1",
        "%201",
        "1%20",
        "%2B1",
        "0x1",
        "\uff11",  # fullwidth one
        "٣",
        str(2**63),
        "9" * 5000,
    ],
)
def test_get_pet_with_malformed_id_returns_404(client, auth, make_pet, pet_id):
    make_pet()
    response = client.get(f"/v1/pets/{pet_id}", headers=auth)
    assert response.status_code == 404
    assert response.get_json()["code"] == "not_found"


def test_get_pet_with_largest_id_is_a_plain_404(client, auth):
    response = client.get(f"/v1/pets/{2**63 - 1}", headers=auth)
    assert response.status_code == 404


def test_list_pets_orders_by_ascending_id_with_default_limit_20(client, auth, make_pet):
    ids = [make_pet(name=f"pet{n}") for n in range(25)]
    response = client.get("/v1/pets", headers=auth)
    assert response.status_code == 200
    body = response.get_json()
    assert [pet["id"] for pet in body] == ids[:20]
    assert body[0] == {"id": ids[0], "name": "pet0", "categoryId": 1, "status": "available"}


@pytest.mark.parametrize(("limit", "expected"), [("1", 1), ("5", 5), ("100", 100), ("007", 7)])
def test_list_pets_honours_limit(client, auth, make_pet, limit, expected):
    ids = [make_pet() for _ in range(101)]
    response = client.get(f"/v1/pets?limit={limit}", headers=auth)
    assert [pet["id"] for pet in response.get_json()] == ids[:expected]


@pytest.mark.parametrize("status", ["available", "pending", "sold"])
def test_list_pets_filters_by_status(client, auth, make_pet, status):
    expected = []
    for n, pet_status in enumerate(["available", "pending", "sold", None] * 3):
        pet_id = make_pet(name=f"p{n}", status=pet_status)
        if pet_status == status:
            expected.append(pet_id)
    response = client.get(f"/v1/pets?status={status}", headers=auth)
    assert [pet["id"] for pet in response.get_json()] == expected


def test_list_pets_empty_store_is_an_empty_array(client, auth):
    response = client.get("/v1/pets", headers=auth)
    assert response.status_code == 200
    assert response.get_json() == []


def test_list_pets_ignores_unknown_query_parameters(client, auth, make_pet):
    pet_id = make_pet()
    response = client.get("/v1/pets?color=brown&page=3", headers=auth)
    assert response.status_code == 200
    assert [pet["id"] for pet in response.get_json()] == [pet_id]


def test_head_answers_like_get_without_body(client, auth, make_pet):
    make_pet()
    response = client.head("/v1/pets", headers=auth)
    assert response.status_code == 200
    assert response.data == b""
