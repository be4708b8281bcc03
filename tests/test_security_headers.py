"""nosniff on every response; authenticated answers are not stored by caches, except that an
answer with an ETag may be kept by the client itself and revalidated (conditional GET)."""

import pytest


@pytest.mark.parametrize(
    ("method", "path", "kwargs", "status"),
    [
        ("get", "/v1/pets", {}, 200),
        ("post", "/v1/pets", {"json": {"name": "Rex", "categoryId": 1}}, 201),
        ("post", "/v1/pets", {"json": {"name": ""}}, 400),
        ("get", "/v1/pets/999", {}, 404),
        ("get", "/v1/nowhere", {}, 404),
        ("delete", "/v1/pets", {}, 405),
        ("get", "/v1/openapi.json", {}, 200),
    ],
)
def test_every_response_says_nosniff(client, auth, method, path, kwargs, status):
    response = client.open(path, method=method, headers=auth, **kwargs)
    assert response.status_code == status
    assert response.headers["X-Content-Type-Options"] == "nosniff"


def test_unauthenticated_error_says_nosniff_and_no_store(client):
    response = client.get("/v1/pets")
    assert response.status_code == 401
    assert response.headers["X-Content-Type-Options"] == "nosniff"
    assert response.headers["Cache-Control"] == "no-store"


@pytest.mark.parametrize(
    ("method", "path", "kwargs", "status"),
    [
        ("post", "/v1/pets", {"json": {"name": "Rex", "categoryId": 1}}, 201),
        ("post", "/v1/pets", {"json": {"name": ""}}, 400),
        ("get", "/v1/pets/999", {}, 404),
    ],
)
def test_authenticated_answer_without_etag_is_not_stored(
    client, auth, method, path, kwargs, status
):
    response = client.open(path, method=method, headers=auth, **kwargs)
    assert response.status_code == status
    assert "ETag" not in response.headers
    assert response.headers["Cache-Control"] == "no-store"


@pytest.mark.parametrize("path", ["/v1/pets", "/v1/pets/{pet_id}"])
def test_answer_with_etag_is_private_and_revalidated(client, auth, make_pet, path):
    path = path.format(pet_id=make_pet())
    response = client.get(path, headers=auth)
    assert response.status_code == 200
    assert response.headers["Cache-Control"] == "private, no-cache"
    again = client.get(path, headers={**auth, "If-None-Match": response.headers["ETag"]})
    assert again.status_code == 304
    assert again.headers["Cache-Control"] == "private, no-cache"
