"""Conditional GET: ETags on listPets and getPet, 304 on a matching If-None-Match."""

import pytest
import sqlalchemy as sa

from animal_store.data.models import Pet
from animal_store.extensions import db


def rename_pet(app, pet_id, name):
    # Animals cannot change through the API; behind its back, in the database, they can.
    with app.app_context():
        db.session.execute(sa.update(Pet).where(Pet.id == pet_id).values(name=name))
        db.session.commit()


@pytest.fixture
def paths(make_pet):
    pet_id = make_pet()
    return {"list": "/v1/pets", "get": f"/v1/pets/{pet_id}"}


@pytest.mark.parametrize("operation", ["list", "get"])
def test_answer_carries_a_strong_etag(client, auth, paths, operation):
    response = client.get(paths[operation], headers=auth)
    etag = response.headers["ETag"]
    assert etag.startswith('"')
    assert etag.endswith('"')
    assert client.get(paths[operation], headers=auth).headers["ETag"] == etag


@pytest.mark.parametrize("operation", ["list", "get"])
@pytest.mark.parametrize(
    "if_none_match",
    ["{tag}", "W/{tag}", '"other", {tag}', '"a",W/{tag} , "b"', "*"],
)
def test_matching_if_none_match_is_304_without_body(client, auth, paths, operation, if_none_match):
    etag = client.get(paths[operation], headers=auth).headers["ETag"]
    response = client.get(
        paths[operation], headers=auth | {"If-None-Match": if_none_match.format(tag=etag)}
    )
    assert response.status_code == 304
    assert response.data == b""
    assert response.headers["ETag"] == etag


@pytest.mark.parametrize("operation", ["list", "get"])
@pytest.mark.parametrize("if_none_match", ['"other"', 'W/"other"', "garbage", ""])
def test_other_if_none_match_gets_the_full_answer(client, auth, paths, operation, if_none_match):
    response = client.get(paths[operation], headers=auth | {"If-None-Match": if_none_match})
    assert response.status_code == 200
    assert response.get_json()


def test_head_with_matching_tag_is_304(client, auth, paths):
    etag = client.get(paths["list"], headers=auth).headers["ETag"]
    response = client.head(paths["list"], headers=auth | {"If-None-Match": etag})
    assert response.status_code == 304


def test_not_modified_get_pet_keeps_its_deprecation_headers(client, auth, paths):
    etag = client.get(paths["get"], headers=auth).headers["ETag"]
    response = client.get(paths["get"], headers=auth | {"If-None-Match": etag})
    assert response.status_code == 304
    assert response.headers["Deprecation"] == "@1795305600"
    assert response.headers["Sunset"] == "Thu, 05 Dec 2030 00:00:00 GMT"
    assert response.headers["Link"] == '</v1/pets>; rel="successor-version"'


@pytest.mark.parametrize(
    ("path", "headers", "status"),
    [("/v1/pets/999", "auth", 404), ("/v1/pets", {}, 401), ("/v1/pets?limit=0", "auth", 400)],
)
def test_errors_have_no_etag_and_ignore_if_none_match(client, auth, path, headers, status):
    headers = (auth if headers == "auth" else headers) | {"If-None-Match": "*"}
    response = client.get(path, headers=headers)
    assert response.status_code == status
    assert "ETag" not in response.headers


def test_get_pet_tag_changes_with_the_animal(make_app, make_key, make_pet):
    # Without kept answers (as an update operation would need), the tag follows the content.
    app = make_app(ANSWER_CACHE_BYTES=0)
    client, auth = app.test_client(), {"Authorization": f"Bearer {make_key()}"}
    pet_id = make_pet()
    before = client.get(f"/v1/pets/{pet_id}", headers=auth).headers["ETag"]
    rename_pet(app, pet_id, "Max")
    response = client.get(f"/v1/pets/{pet_id}", headers=auth | {"If-None-Match": before})
    assert response.status_code == 200
    assert response.get_json()["name"] == "Max"
    assert response.headers["ETag"] != before


def test_list_tag_changes_when_an_animal_is_added(client, auth, make_pet):
    make_pet()
    before = client.get("/v1/pets", headers=auth).headers["ETag"]
    make_pet(name="Max")
    response = client.get("/v1/pets", headers=auth | {"If-None-Match": before})
    assert response.status_code == 200
    assert len(response.get_json()) == 2


def test_list_tag_changes_when_a_next_page_appears(client, auth, make_pet):
    make_pet()
    before = client.get("/v1/pets?limit=1", headers=auth)
    make_pet(name="Max")
    after = client.get("/v1/pets?limit=1", headers=auth | {"If-None-Match": before.headers["ETag"]})
    # Same body, but now with a Link to the next page the client must see.
    assert after.status_code == 200
    assert after.get_json() == before.get_json()
    assert "Link" in after.headers


def test_each_page_and_filter_has_its_own_tag(client, auth, make_pet):
    for status in ("available", "sold", "available"):
        make_pet(status=status)
    tags = {
        client.get(path, headers=auth).headers["ETag"]
        for path in ("/v1/pets", "/v1/pets?status=sold", "/v1/pets?limit=1", "/v1/pets?limit=2")
    }
    assert len(tags) == 4
