"""Bad input gets a 4xx error object naming the problem and leaves the store as it was."""

import io
import json

import pytest

VALID = {"name": "Rex", "categoryId": 1}


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"categoryId": 1}, "name"),
        ({"name": "Rex"}, "categoryId"),
        ({}, "name"),
        ({"name": "", "categoryId": 1}, "name"),
        ({"name": "   ", "categoryId": 1}, "name"),
        ({"name": "\t\n", "categoryId": 1}, "name"),
        ({"name": "a" * 256, "categoryId": 1}, "name"),
        ({"name": "Re\x00x", "categoryId": 1}, "name"),
        ({"name": "Re\x07x", "categoryId": 1}, "name"),
        ({"name": None, "categoryId": 1}, "name"),
        ({"name": 5, "categoryId": 1}, "name"),
        ({"name": ["Rex"], "categoryId": 1}, "name"),
        ({"name": "Rex", "categoryId": "1"}, "categoryId"),
        ({"name": "Rex", "categoryId": 1.5}, "categoryId"),
        ({"name": "Rex", "categoryId": 1.0}, "categoryId"),
        ({"name": "Rex", "categoryId": True}, "categoryId"),
        ({"name": "Rex", "categoryId": None}, "categoryId"),
        ({"name": "Rex", "categoryId": 2**63}, "categoryId"),
        ({"name": "Rex", "categoryId": -(2**63) - 1}, "categoryId"),
        ({"name": "Rex", "categoryId": 10**30}, "categoryId"),
        ({"name": "Rex", "categoryId": {}}, "categoryId"),
        ({"name": "Rex", "categoryId": 1, "status": "lost"}, "status"),
        ({"name": "Rex", "categoryId": 1, "status": "Available"}, "status"),
        ({"name": "Rex", "categoryId": 1, "status": None}, "status"),
        ({"name": "Rex", "categoryId": 1, "status": ""}, "status"),
        ({"name": "Rex", "categoryId": 1, "id": 5}, "id"),
        ({"name": "Rex", "categoryId": 1, "color": "brown"}, "color"),
    ],
)
def test_create_pet_with_invalid_field_returns_400_naming_it(client, auth, count_pets, body, field):
    # The standard library writes integers past int64 that orjson, the app's encoder, refuses.
    response = client.post(
        "/v1/pets", data=json.dumps(body), content_type="application/json", headers=auth
    )
    assert response.status_code == 400
    error = response.get_json()
    assert error["code"] == "validation_error"
    assert error["status"] == 400
    assert field in error["message"]
    assert field in error["errors"]
    assert count_pets() == 0


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"   ",
        b"{",
        b'{"name": "Rex", "categoryId": 1',
        b"nul",
        b"[]",
        b'[{"name": "Rex"}]',
        b'"Rex"',
        b"42",
        b"null",
        b"true",
        b'{"name": "Rex", "categoryId": NaN}',
        b'{"name": "Rex", "categoryId": Infinity}',
        b'{"name": "Rex", "categoryId": -Infinity}',
        b'{"name": "Rex", "categoryId": 1e400}',
        b"\xef\xbb\xbf" + b'{"name": "Rex", "categoryId": 1}',
        b'{"name": "R\xffx", "categoryId": 1}',
        b'{"name": "\\ud800", "categoryId": 1}',
        b"{'name': 'Rex', 'categoryId': 1}",
        b'{"name": "Rex", "categoryId": 1,}',
        b"[" * 30_000 + b"]" * 30_000,
        b'{"a":' * 6_000 + b"1" + b"}" * 6_000,
    ],
)
def test_create_pet_with_malformed_json_returns_400(client, auth, count_pets, raw):
    response = client.post(
        "/v1/pets", data=raw, headers=auth | {"Content-Type": "application/json"}
    )
    assert response.status_code == 400
    assert response.get_json()["code"] in ("invalid_json", "validation_error")
    assert count_pets() == 0


FIX_JSON = (
    "send one JSON object, in UTF-8, its names and strings in double quotes, "
    "with no trailing comma."
)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"", "The body is empty: send one JSON object."),
        (b" \r\n\t", "The body is empty: send one JSON object."),
        (
            b'{"name": "Rex",\n "categoryId": 1',
            f"The body is not valid JSON at line 2, column 17: {FIX_JSON}",
        ),
        (b"{'name': 'Rex'}", f"The body is not valid JSON at line 1, column 2: {FIX_JSON}"),
        (
            b'{"name": "Rex", "categoryId": 1,}',
            f"The body is not valid JSON at line 1, column 32: {FIX_JSON}",
        ),
        (
            b'{"name": "Rex", "categoryId": NaN}',
            f"The body is not valid JSON at line 1, column 31: {FIX_JSON}",
        ),
        (b"[]", "The body must be a JSON object."),
    ],
)
def test_a_body_that_is_no_json_object_is_answered_with_what_to_fix(client, auth, raw, message):
    response = client.post(
        "/v1/pets", data=raw, headers=auth | {"Content-Type": "application/json"}
    )
    assert response.status_code == 400
    assert response.get_json() == {"code": "invalid_json", "message": message, "status": 400}


def twice_message(name):
    return (
        f"The body names member '{name}' twice in one object: send each member of an object once."
    )


@pytest.mark.parametrize(
    ("raw", "name"),
    [
        (b'{"name": "Max", "name": "Rex", "categoryId": 1}', "name"),
        (b'{"name": "Rex", "categoryId": 2, "categoryId": 1}', "categoryId"),
        # One name once its escapes are read (RFC 7493, section 2.3).
        (b'{"name": "Max", "n\\u0061me": "Rex", "categoryId": 1}', "name"),
        # Colons and quotes in strings, which a reading of the text must not take for members.
        (b'{"name": "Max: \\"one\\":", "name": "Rex", "categoryId": 1}', "name"),
        (b'{"name": "Rex", "categoryId": 1, "extra": {"a": 1, "a": 2}}', "a"),
        (b'{"name": "Rex", "categoryId": 1, "extra": [{"a": 1}, {"a": 1, "a": 1}]}', "a"),
        (b'{"name": "Rex", "categoryId": 1, "x": {"{:": {"\\"": 1, "\\"": 2}}}', '"'),
        # Near orjson's deepest (1024), past the standard library parser's recursion limit.
        (b'{"x": ' + b'{"x": ' * 1_000 + b'{"q": 1, "q": 2}' + b"}" * 1_001, "q"),
    ],
)
def test_a_body_naming_a_member_twice_is_400(client, auth, count_pets, raw, name):
    # Whatever reads the first of the two (a filter in front of the service) would judge another
    # animal than the one the last would store.
    response = client.post(
        "/v1/pets", data=raw, headers=auth | {"Content-Type": "application/json"}
    )
    assert response.status_code == 400
    assert response.get_json() == {
        "code": "invalid_json",
        "message": twice_message(name),
        "status": 400,
    }
    assert count_pets() == 0


@pytest.mark.parametrize(
    "name",
    ["Rex: the second", 'Rex "name": 1', "Rex\\", "{name:", "name"],
)
def test_a_name_with_colons_or_quotes_is_no_member_twice(client, auth, name):
    response = client.post("/v1/pets", json={"name": name, "categoryId": 1}, headers=auth)
    assert response.status_code == 201
    assert response.get_json()["name"] == name


def test_one_name_in_two_objects_is_no_member_twice(client, auth):
    body = b'{"name": "Rex", "categoryId": 1, "x": {"name": 1}, "y": [{"a": 1}, {"a": {"a": 1}}]}'
    response = client.post(
        "/v1/pets", data=body, headers=auth | {"Content-Type": "application/json"}
    )
    # Read whole, and refused only for its fields.
    assert response.status_code == 400
    assert response.get_json()["code"] == "validation_error"
    assert response.get_json()["errors"].keys() == {"x", "y"}


@pytest.mark.parametrize(
    "content_type",
    [
        None,
        "text/plain",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
        "application/merge-patch+json",
        "text/json",
        "application/jsonx",
    ],
)
def test_create_pet_with_other_media_type_returns_415(client, auth, count_pets, content_type):
    headers = auth | ({"Content-Type": content_type} if content_type else {})
    response = client.post("/v1/pets", data=b'{"name": "Rex", "categoryId": 1}', headers=headers)
    assert response.status_code == 415
    assert response.get_json()["code"] == "unsupported_media_type"
    assert count_pets() == 0


@pytest.mark.parametrize("chunked", [False, True])
def test_create_pet_with_oversized_body_returns_413(app, client, auth, count_pets, chunked):
    limit = app.config["MAX_CONTENT_LENGTH"]
    body = b'{"name": "' + b"a" * limit + b'", "categoryId": 1}'
    headers = auth | {"Content-Type": "application/json"}
    if chunked:
        # No Content-Length: the limit must hold on the stream itself.
        environ = {"wsgi.input_terminated": True}
        response = client.post(
            "/v1/pets",
            input_stream=io.BytesIO(body),
            headers=headers | {"Transfer-Encoding": "chunked"},
            environ_overrides=environ,
        )
    else:
        response = client.post("/v1/pets", data=body, headers=headers)
    assert response.status_code == 413
    assert response.get_json() == {
        "code": "payload_too_large",
        "status": 413,
        "message": f"The request body is larger than the limit of {limit} bytes.",
    }
    assert count_pets() == 0


def test_body_limit_is_configurable(make_app, auth):
    app = make_app(MAX_CONTENT_LENGTH=100)
    response = app.test_client().post(
        "/v1/pets", json={"name": "a" * 100, "categoryId": 1}, headers=auth
    )
    assert response.status_code == 413


@pytest.mark.parametrize(
    ("query", "parameter"),
    [
        ("limit=0", "limit"),
        ("limit=101", "limit"),
        ("limit=-1", "limit"),
        ("limit=+5", "limit"),
        ("limit=%205", "limit"),
        ("limit=5%20", "limit"),
        ("limit=1e2", "limit"),
        ("limit=5.0", "limit"),
        ("limit=", "limit"),
        ("limit=abc", "limit"),
        ("limit=%EF%BC%95", "limit"),
        ("limit=%D9%A3", "limit"),
        ("limit=" + "9" * 5000, "limit"),
        ("limit=0x10", "limit"),
        ("status=lost", "status"),
        ("status=", "status"),
        ("status=AVAILABLE", "status"),
    ],
)
def test_list_pets_with_invalid_query_returns_400_naming_it(client, auth, query, parameter):
    # Twice: a worker remembers the arguments of the queries it has parsed, never a refusal.
    for _ in range(2):
        response = client.get(f"/v1/pets?{query}", headers=auth)
        assert response.status_code == 400
        error = response.get_json()
        assert error["code"] == "validation_error"
        assert parameter in error["message"]
        assert parameter in error["errors"]


def test_a_remembered_query_gives_its_own_arguments(client, auth, make_pet):
    for number in range(5):
        make_pet(name=f"pet {number}", status="sold" if number % 2 else "available")
    for _ in range(2):
        for query, ids in [
            ("limit=2", [1, 2]),
            ("limit=3&status=sold", [2, 4]),
            ("", [1, 2, 3, 4, 5]),
        ]:
            page = client.get(f"/v1/pets?{query}", headers=auth).get_json()
            assert [pet["id"] for pet in page] == ids
