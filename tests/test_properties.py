"""Property-based tests of the request schemas (Hypothesis, derandomized and bounded): any JSON
value in any field of a creation, or any query, is answered without a 500 and stores nothing
that is not a valid animal."""

import json
import unicodedata

import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from animal_store.data.models import PET_STATUSES, Pet
from animal_store.extensions import db

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

# The same examples on every run (CI repeatable), few enough to take seconds.
bounded = settings(
    max_examples=150,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=5), children, max_size=3)
    ),
    max_leaves=6,
)
# The two required fields are always there (absent ones are tests/test_validation.py's), each
# either a plausible value or any JSON at all; the optional and unknown fields come and go.
create_bodies = st.fixed_dictionaries(
    {
        # Around the length limit too, where random text rarely goes.
        "name": st.text(max_size=20)
        | st.text(st.characters(categories=["L", "N"]), min_size=254, max_size=256)
        | json_values,
        "categoryId": st.integers(INT64_MIN - 10, INT64_MAX + 10) | json_values,
    },
    optional={
        "status": st.sampled_from(PET_STATUSES) | json_values,
        "id": json_values,
        "extra": json_values,
    },
)


def is_valid_animal(name, category_id, status) -> bool:
    """The rules of the contract, restated independently of the schemas."""
    return (
        isinstance(name, str)
        and 1 <= len(name) <= 255
        and name.strip() != ""
        and not any(unicodedata.category(char) in ("Cc", "Cs") for char in name)
        and type(category_id) is int
        and INT64_MIN <= category_id <= INT64_MAX
        and status in (*PET_STATUSES, None)
    )


@pytest.fixture
def unlimited(make_app, make_key):
    app = make_app(RATELIMIT_ENABLED=False)
    return app, app.test_client(), {"Authorization": f"Bearer {make_key()}"}


def stored(app):
    with app.app_context():
        rows = db.session.execute(sa.select(Pet.id, Pet.name, Pet.category_id, Pet.status))
        return {row.id: (row.name, row.category_id, row.status) for row in rows}


@bounded
@given(body=create_bodies)
def test_any_creation_body_is_answered_and_stores_only_valid_animals(unlimited, body):
    app, client, headers = unlimited
    before = stored(app)
    # json.dumps writes NaN and Infinity, which are not JSON: the service must refuse them too.
    response = client.post(
        "/v1/pets", data=json.dumps(body), content_type="application/json", headers=headers
    )
    assert response.status_code in (201, 400), response.get_data()
    after = stored(app)
    if response.status_code == 400:
        assert response.get_json()["code"] in ("validation_error", "invalid_json")
        assert after == before
        return
    created = response.get_json()
    assert set(after) - set(before) == {created["id"]}
    row = after[created["id"]]
    assert is_valid_animal(*row)
    assert row == (body["name"], body["categoryId"], body.get("status"))


query_values = (
    st.text(max_size=30)
    | st.integers().map(str)
    | st.sampled_from(
        ["1", "100", "101", "0", "-1", "\uff11", "\u0663", "1e2", "available", "sold", "", "AAAA"]
    )
)


@bounded
@given(query=st.dictionaries(st.sampled_from(["limit", "status", "cursor", "other"]), query_values))
def test_any_list_query_is_answered_without_a_server_error(unlimited, query):
    _, client, headers = unlimited
    response = client.get("/v1/pets", query_string=query, headers=headers)
    assert response.status_code in (200, 400), response.get_data()
    if response.status_code == 200:
        assert isinstance(response.get_json(), list)
        assert len(response.get_json()) <= 100
    else:
        assert response.get_json()["code"] == "validation_error"


# Objects written member by member, so that a name can come twice, spelt with its escapes or
# without; names and strings hold what a reading of the text could take for structure.
names = st.sampled_from(["a", "b", "é", ":", '"', "\\", "{[", '"a":'])
written_values = st.recursive(
    st.sampled_from(["1", "null", '"a"', '":"', '"\\":{"']),
    lambda children: (
        st.lists(children, max_size=3).map(lambda items: f"[{', '.join(items)}]")
        | st.lists(st.tuples(names, st.booleans(), children), max_size=4).map(
            lambda members: (
                "{"
                + ", ".join(f"{json.dumps(n, ensure_ascii=a)}: {v}" for n, a, v in members)
                + "}"
            )
        )
    ),
    max_leaves=12,
)


def repeated_names(text: str) -> set[str]:
    """The names an object of `text` has twice, as the standard library reads them."""
    repeated = set()

    def pairs(members):
        seen = set()
        for name, _ in members:
            (repeated if name in seen else seen).add(name)
        return dict(members)

    json.loads(text, object_pairs_hook=pairs)
    return repeated


@bounded
@given(extra=written_values)
def test_a_body_is_refused_for_a_member_twice_exactly_when_it_has_one(unlimited, extra):
    _, client, headers = unlimited
    text = f'{{"name": "Rex", "categoryId": 1, "extra": {extra}}}'
    response = client.post("/v1/pets", data=text, content_type="application/json", headers=headers)
    assert response.status_code == 400
    repeated = repeated_names(text)
    if not repeated:
        # Read whole: only the unknown field is refused.
        assert response.get_json()["code"] == "validation_error"
        return
    assert response.get_json()["code"] == "invalid_json"
    assert response.get_json()["message"] in {
        f"The body names member '{name}' twice in one object: send each member of an object once."
        for name in repeated
    }
