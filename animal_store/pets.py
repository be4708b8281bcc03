"""The animals resource: listPets, createPet and the deprecated getPet."""

from collections.abc import Sequence
from typing import cast

import orjson
from flask import Response, make_response, url_for

from animal_store import errors
from animal_store.api import Blueprint, Header
from animal_store.api.conditional import conditional
from animal_store.data import store
from animal_store.data.answers import Kept, answers, json_response
from animal_store.data.filters import walk_of
from animal_store.data.keyset import settled_prefix
from animal_store.data.pagination import next_page_link, next_page_query
from animal_store.data.store import NewPet, PetRow
from animal_store.idempotency import (
    IDEMPOTENT_REPLAYED,
    creation_transaction,
    idempotent,
    remember,
)
from animal_store.links import absolute_url
from animal_store.schemas import (
    FILTER_NAMES,
    ID_MIN,
    INT64_MAX,
    ListQuery,
    ListQuerySchema,
    NewPetSchema,
    PetSchema,
)

bp = Blueprint("pets", __name__)

# Instances, not classes: webargs and flask-smorest would make a new instance per request.
pet_schema = PetSchema()
pets_schema = PetSchema(many=True)
new_pet_schema = NewPetSchema()
list_query_schema = ListQuerySchema()

LOCATION = Header(
    "Location", "The absolute URL of the new animal.", {"type": "string", "format": "uri"}, True
)
NEXT_LINK = Header(
    "Link",
    f'RFC 8288: `<absolute URL>; rel="next"`, the next page with the same `limit` and filters '
    f"({FILTER_NAMES}); absent on the last page. Follow it, do not build the cursor.",
    {"type": "string"},
    component="NextLink",
)
PET_ID = {
    "in": "path",
    "name": "petId",
    "schema": {"type": "integer", "format": "int64", "minimum": ID_MIN, "maximum": INT64_MAX},
    "description": "The animal's id, in ASCII digits without a leading zero. Anything else "
    "(text, zero, negative, too large, leading zeros) is 404.",
}


@bp.route("/pets", methods=["GET"])
@bp.doc(operationId="listPets")
@conditional
@bp.arguments(list_query_schema, location="query")
@bp.response(200, pets_schema, description="A page of animals.", headers={"Link": NEXT_LINK})
def list_pets(query: ListQuery) -> Sequence[PetRow] | Response:
    """List animals, a page at a time, in ascending id order; optionally only those the filters
    keep."""
    limit, walk = query["limit"], walk_of(query)
    after = query["cursor"].last_id if "cursor" in query else 0
    # The walk is the key's, whole: a page kept for some filters is never another's.
    kept = answers().get(("page", after, limit, walk))
    if kept is None:
        # One row past the page tells whether another page follows.
        rows = store.pets_after(after, limit + 1, walk)
        pets = settled_prefix(rows)
        if len(pets) == len(rows) <= limit:
            return pets  # the end of the list, which grows: made afresh each time
        pets = pets[:limit]
        last_id = pets[-1]["id"] if pets else after
        kept = Kept(orjson.dumps(pets_schema.dump(pets)), next_page_query(last_id, limit, walk))
        if len(pets) == limit:
            answers().put(("page", after, limit, walk), *kept)
        # Otherwise cut short before a row not yet settled: the rest follows once it is, and
        # the page is not kept.
    body, next_query = kept
    response = json_response(body)
    # A page's answer, which always has the query of its next page (an animal's has none).
    response.headers.add("Link", next_page_link(cast(str, next_query)))
    return response


@bp.route("/pets", methods=["POST"])
@bp.doc(operationId="createPet")
@bp.arguments(new_pet_schema)
@bp.response(
    201,
    pet_schema,
    description="The new animal, with its id.",
    headers={"Location": LOCATION, "Idempotent-Replayed": IDEMPOTENT_REPLAYED},
)
@idempotent
def create_pet(pet: NewPet) -> Response:
    """Add an animal and return it with its new id."""
    with creation_transaction() as connection:
        pet_id = store.add_pet(connection, pet)
        location = absolute_url(url_for(".get_pet", pet_id=pet_id))
        body = pet_schema.dump({**pet, "id": pet_id})
        response = make_response(body, 201, {"Location": location})
        # The answer a retry with the same Idempotency-Key gets, committed with the animal.
        remember(connection, response)
    return response


@bp.route("/pets/<pet_id>", methods=["GET"], parameters=[PET_ID])
@bp.doc(operationId="getPet")
@bp.deprecated("GET_PET_DEPRECATION")
@bp.errors(errors.PET_NOT_FOUND)
@conditional
@bp.response(200, pet_schema, description="The animal.")
def get_pet(pet_id: str) -> Response:
    """Get an animal (deprecated: list animals with the status filter instead)."""
    kept = answers().get(("pet", pet_id))
    if kept is None:
        pet = store.find_pet(int(pet_id)) if is_pet_id(pet_id) else None
        if pet is None:
            raise errors.PET_NOT_FOUND(pet_id=pet_id)  # never kept: the animal may come
        kept = Kept(orjson.dumps(pet_schema.dump(pet)))
        answers().put(("pet", pet_id), *kept)
    return json_response(kept[0])


def is_pet_id(text: str) -> bool:
    # Ids are positive int64 written in ASCII digits, as Location and the bodies write them:
    # anything else names no animal. Not with a leading zero either: /v1/pets/01 would be a
    # second URL of animal 1, cached apart and compared unequal by clients.
    return (
        text.isascii()
        and text.isdigit()
        and not text.startswith("0")
        and len(text) <= 19
        and int(text) <= INT64_MAX
    )
