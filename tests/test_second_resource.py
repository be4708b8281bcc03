"""Nothing outside pets.py assumes pets: a second resource (tests/widgets.py), registered as
docs/development.rst says, gets from the layer with no code of its own: Idempotency-Keys scoped to
its path, its headers documented with its own descriptions, pages ordered and exact by the keyset
mechanism, a duplicate answered as an error object, and its methods allowed to browsers."""

import psycopg
import pytest
import sqlalchemy as sa
import widgets
from openapi_spec_validator import validate
from test_errors import assert_error_object

from animal_store import RESOURCES, pets
from animal_store.extensions import db

WITH_WIDGETS = (*RESOURCES, widgets.bp)
SHOP = "https://shop.example"
# Valid for both resources: widgets ignore categoryId.
BODY = {"name": "Rex", "categoryId": 1}


@pytest.fixture
def app(make_app):
    app = make_app(resources=WITH_WIDGETS)
    with app.app_context(), db.engine.begin() as connection:
        widgets.make_table(connection)
    yield app
    with app.app_context(), db.engine.begin() as connection:
        widgets.drop_table(connection)


@pytest.fixture
def count_widgets(app):
    def count():
        with app.app_context():
            return db.session.scalar(sa.select(sa.func.count()).select_from(widgets.TABLE))

    return count


def widget_ids(client, auth, url):
    """Walk the list from url; return the ids in the order seen and the number of pages."""
    seen, pages = [], 0
    while url is not None:
        response = client.get(url, headers=auth)
        assert response.status_code == 200
        seen += [widget["id"] for widget in response.get_json()]
        pages += 1
        link = response.headers.get("Link")
        url = link.split(">")[0].split("localhost", 1)[1] if link else None
    return seen, pages


@pytest.mark.parametrize("first", ["/v1/pets", "/v1/widgets"])
def test_the_same_key_and_body_on_two_paths_never_replay_each_other(
    client, auth, count_pets, count_widgets, first
):
    headers = auth | {"Idempotency-Key": "shared-key"}
    paths = sorted({"/v1/pets", "/v1/widgets"}, key=lambda path: path != first)
    made = {path: client.post(path, json=BODY, headers=headers) for path in paths}
    for path, response in made.items():
        assert response.status_code == 201
        assert "Idempotent-Replayed" not in response.headers
        assert response.headers["Location"].startswith(f"http://localhost{path}/")
    assert (count_pets(), count_widgets()) == (1, 1)
    # Each path replays its own answer to a retry, and refuses its key with another body.
    for path, response in made.items():
        again = client.post(path, json=BODY, headers=headers)
        assert again.status_code == 201
        assert again.headers["Idempotent-Replayed"] == "true"
        assert again.get_json() == response.get_json()
        assert again.headers["Location"] == response.headers["Location"]
        other_body = client.post(path, json=BODY | {"name": "Tom"}, headers=headers)
        assert_error_object(other_body, 422, "idempotency_key_reused")
    assert (count_pets(), count_widgets()) == (1, 1)


def test_headers_are_documented_with_their_own_descriptions(client):
    document = client.get("/v1/openapi.json").get_json()
    validate(document)

    def location(path):
        reference = document["paths"][path]["post"]["responses"]["201"]["headers"]["Location"]
        return document["components"]["headers"][reference["$ref"].rsplit("/", 1)[1]]

    assert location("/pets")["description"] == pets.LOCATION.description
    assert location("/widgets")["description"] == widgets.LOCATION.description
    # Headers alike share one component, whichever resource declared them.
    replayed = {
        document["paths"][path]["post"]["responses"]["201"]["headers"]["Idempotent-Replayed"][
            "$ref"
        ]
        for path in ("/pets", "/widgets")
    }
    assert len(replayed) == 1


def test_pages_are_in_id_order_and_see_each_widget_once(client, auth):
    names = [f"Widget {n}" for n in range(5)]
    made = [
        client.post("/v1/widgets", json={"name": name}, headers=auth).get_json()["id"]
        for name in names
    ]
    assert client.get(f"/v1/widgets/{made[2]}", headers=auth).get_json() == {
        "id": made[2],
        "name": names[2],
    }
    seen, pages = widget_ids(client, auth, "/v1/widgets?limit=2")
    assert seen == sorted(made)
    assert pages == 3


def test_its_ids_are_taken_by_a_trigger_of_its_own_which_goes_with_the_table(app, postgres_url):
    triggers = sa.text(
        "SELECT tgfoid::regproc::text FROM pg_trigger "
        "WHERE tgrelid = to_regclass('widgets') AND NOT tgisinternal"
    )
    with app.app_context(), db.engine.begin() as connection:
        assert connection.scalars(triggers).all() == ["widgets_take_id"]
        widgets.drop_table(connection)
        assert connection.scalar(sa.text("SELECT to_regproc('widgets_take_id')")) is None
        widgets.make_table(connection)  # for the fixture to drop


def test_a_page_stops_before_a_widget_still_in_flight(client, auth, postgres_url):
    first = client.post("/v1/widgets", json={"name": "First"}, headers=auth).get_json()["id"]
    with psycopg.connect(postgres_url) as in_flight:
        late = in_flight.execute(
            "INSERT INTO widgets (name) VALUES ('Late') RETURNING id"
        ).fetchone()[0]
        quick = client.post("/v1/widgets", json={"name": "Quick"}, headers=auth)
        assert quick.get_json()["id"] > late
        response = client.get("/v1/widgets?limit=10", headers=auth)
        # The quick one is committed, but shown only after the one in flight below it.
        assert [widget["id"] for widget in response.get_json()] == [first]
        assert "Link" in response.headers
        in_flight.commit()
    seen, _ = widget_ids(client, auth, "/v1/widgets?limit=10")
    assert seen == [first, late, quick.get_json()["id"]]


@pytest.mark.parametrize("idempotency_key", [None, "duplicate"])
def test_a_duplicate_name_is_an_error_object_and_changes_nothing(
    client, auth, count_widgets, idempotency_key
):
    made = client.post("/v1/widgets", json={"name": "Cats"}, headers=auth)
    assert made.status_code == 201
    headers = auth | ({"Idempotency-Key": idempotency_key} if idempotency_key else {})
    for _ in range(2):  # a retry with the same key runs again: the error was not remembered
        duplicate = client.post("/v1/widgets", json={"name": "Cats"}, headers=headers)
        assert_error_object(duplicate, 409, "already_exists")
        assert "Idempotent-Replayed" not in duplicate.headers
    assert count_widgets() == 1
    assert client.get("/v1/widgets", headers=auth).get_json() == [made.get_json()]
    # The session was rolled back: the next creation, on the same worker, goes through.
    other = client.post("/v1/widgets", json={"name": "Dogs"}, headers=headers)
    assert other.status_code == 201
    assert count_widgets() == 2


def test_a_duplicate_is_documented_as_409(client, auth):
    document = client.get("/v1/openapi.json").get_json()
    conflict = document["paths"]["/widgets"]["post"]["responses"]["409"]
    assert "`already_exists`" in conflict["description"]
    # Its 409 shares the status with idempotency_key_in_use, whose Retry-After a duplicate does
    # not send: documented, but not required.
    reference = conflict["headers"]["Retry-After"]["$ref"].rsplit("/", 1)[-1]
    assert document["components"]["headers"][reference]["required"] is False
    client.post("/v1/widgets", json={"name": "Cats"}, headers=auth)
    duplicate = client.post("/v1/widgets", json={"name": "Cats"}, headers=auth)
    assert duplicate.status_code == 409
    assert "Retry-After" not in duplicate.headers


def header_set(value):
    return {item.strip().upper() for item in value.split(",")}


def layer_methods(app):
    return {
        method
        for rule in app.url_map.iter_rules()
        if rule.endpoint.startswith("v1.")
        for method in rule.methods
    }


def test_browsers_may_use_its_methods(app, make_app, auth):
    cors_app = make_app(resources=WITH_WIDGETS, CORS_ORIGINS=[SHOP])
    client = cors_app.test_client()
    asking = {"Origin": SHOP, "Access-Control-Request-Method": "DELETE"}
    preflight = client.options("/v1/widgets/1", headers=asking)
    assert preflight.status_code == 204
    assert preflight.headers["Access-Control-Allow-Origin"] == SHOP
    allowed = header_set(preflight.headers["Access-Control-Allow-Methods"])
    assert allowed == layer_methods(cors_app)
    assert "DELETE" in allowed
    made = client.post("/v1/widgets", json={"name": "Gone"}, headers=auth | {"Origin": SHOP})
    deleted = client.delete(made.headers["Location"], headers=auth | {"Origin": SHOP})
    assert deleted.status_code == 204
    assert deleted.headers["Access-Control-Allow-Origin"] == SHOP


def test_browsers_may_not_use_a_method_no_route_has(make_app):
    client = make_app(CORS_ORIGINS=[SHOP]).test_client()
    asking = {"Origin": SHOP, "Access-Control-Request-Method": "DELETE"}
    preflight = client.options("/v1/pets", headers=asking)
    # Without the method in Access-Control-Allow-Methods, a browser does not send the request.
    assert "Access-Control-Allow-Methods" not in preflight.headers


def test_an_import_that_skips_the_widgets_it_has_holds_two_marks_at_most(
    client, auth, postgres_url
):
    # INSERT ... ON CONFLICT DO NOTHING takes an id for each row, and so runs the trigger, but
    # writes no row where the name is taken: the transaction gets no id of its own from such a
    # row, and each would mark anew. (A nextval that logs the sequence, every 32 ids or after a
    # checkpoint, gives the transaction an id too; the first widget's has just done so.)
    names = [f"Widget {n}" for n in range(5)]
    for name in names:
        assert client.post("/v1/widgets", json={"name": name}, headers=auth).status_code == 201
    with psycopg.connect(postgres_url) as importing:
        importing.execute(
            "INSERT INTO widgets (name) SELECT unnest(%s::text[]) ON CONFLICT (name) DO NOTHING",
            (names,),
        )
        marks = importing.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()"
        ).fetchone()[0]
        assert marks <= 2
        importing.rollback()
