"""Answers that cannot change are reused: an animal's and a full page's bodies, per worker, within
ANSWER_CACHE_BYTES; never the end of the list, a 404, or anything made from a request's headers."""

from urllib.parse import urlencode

import pytest
import sqlalchemy as sa

from animal_store.data.answers import Answers
from animal_store.data.filters import LIST_FILTERS
from animal_store.data.models import Pet
from animal_store.extensions import db


def rename_behind_the_apis_back(app, name):
    with app.app_context():
        db.session.execute(sa.update(Pet).values(name=name))
        db.session.commit()


def test_an_animal_and_a_full_page_are_sent_again_as_they_were(app, client, auth, make_pet):
    for _ in range(3):
        make_pet()
    first = {path: client.get(path, headers=auth) for path in ("/v1/pets/1", "/v1/pets?limit=2")}
    rename_behind_the_apis_back(app, "Changed")
    for path, before in first.items():
        again = client.get(path, headers=auth)
        assert again.get_data() == before.get_data()  # reused, not read again
        assert again.headers["ETag"] == before.headers["ETag"]
        assert "Changed" not in again.get_data(as_text=True)


def test_the_end_of_the_list_and_a_404_are_never_kept(client, auth, make_pet):
    make_pet()
    assert client.get("/v1/pets/2", headers=auth).status_code == 404
    assert len(client.get("/v1/pets?limit=5", headers=auth).get_json()) == 1
    make_pet(name="Max")
    assert client.get("/v1/pets/2", headers=auth).get_json()["name"] == "Max"
    assert len(client.get("/v1/pets?limit=5", headers=auth).get_json()) == 2


def test_a_kept_page_links_to_each_requests_own_host(client, auth, make_pet):
    for _ in range(3):
        make_pet()
    links = [
        client.get("/v1/pets?limit=2", headers=auth, base_url=base).headers["Link"]
        for base in ("http://one.example", "http://two.example")
    ]
    assert links[0].startswith("<http://one.example/v1/pets?")
    assert links[1].startswith("<http://two.example/v1/pets?")
    assert links[0].replace("one", "two") == links[1]


def test_kept_answers_stay_within_their_bytes():
    kept = Answers(size_bytes=1000)
    for n in range(100):
        kept.put(("pet", n), b"x" * 100)
    assert kept.entries.currsize <= 1000
    assert kept.get(("pet", 99)) == (b"x" * 100, None)  # the most recent stay
    assert kept.get(("pet", 0)) is None
    kept.put(("page", 1), b"y" * 2000)  # larger than the whole: not kept
    assert kept.get(("page", 1)) is None


def test_no_answers_are_kept_when_the_setting_is_zero(make_app, make_key, make_pet):
    app = make_app(ANSWER_CACHE_BYTES=0)
    client, auth = app.test_client(), {"Authorization": f"Bearer {make_key()}"}
    make_pet()
    client.get("/v1/pets/1", headers=auth)
    rename_behind_the_apis_back(app, "Changed")
    assert client.get("/v1/pets/1", headers=auth).get_json()["name"] == "Changed"


# Every walk a first page can be asked for with one filter, and the walk with none.
WALKS = [{}] + [
    {list_filter.name: value} for list_filter in LIST_FILTERS for value in list_filter.choices
]


@pytest.mark.parametrize("walk", WALKS, ids=lambda walk: urlencode(walk) or "unfiltered")
def test_a_kept_page_is_served_to_its_own_walk_only(client, auth, make_pet, walk):
    # Two animals of each value of each filter, so that every walk's first page is full, kept,
    # and shows another animal than the other walks' first pages.
    for list_filter in LIST_FILTERS:
        for value in list_filter.choices:
            for _ in range(2):
                make_pet(**{list_filter.column.key: value})
    for other in WALKS:
        client.get("/v1/pets?" + urlencode({"limit": 1, **other}), headers=auth)
    for _ in range(2):  # read, then kept
        page = client.get("/v1/pets?" + urlencode({"limit": 1, **walk}), headers=auth).get_json()
        assert [pet for pet in page if walk.items() <= pet.items()] == page != []
