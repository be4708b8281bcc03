"""The animals resource: listPets, createPet and the deprecated getPet."""

from email.utils import format_datetime

import orjson
from flask import Blueprint, current_app, request, url_for
from marshmallow import ValidationError
from werkzeug.exceptions import RequestEntityTooLarge

from animal_store.auth import authenticate
from animal_store.errors import APIError
from animal_store.extensions import db
from animal_store.models import Pet
from animal_store.schemas import INT64_MAX, ListQuerySchema, NewPetSchema, PetSchema

bp = Blueprint("pets", __name__)
bp.before_request(authenticate)

pet_schema = PetSchema()
pets_schema = PetSchema(many=True)
new_pet_schema = NewPetSchema()
list_query_schema = ListQuerySchema()


@bp.get("/pets")
def list_pets():
    """List animals in ascending id order, optionally only those with one status."""
    query = load(list_query_schema, request.args, "Invalid query parameter")
    select = db.select(Pet).order_by(Pet.id).limit(query["limit"])
    if "status" in query:
        select = select.where(Pet.status == query["status"])
    return pets_schema.dump(db.session.scalars(select)), 200


@bp.post("/pets")
def create_pet():
    """Add an animal and return it with its new id."""
    pet = Pet(**load(new_pet_schema, json_object_body(), "Invalid request body"))
    db.session.add(pet)
    db.session.commit()
    return (
        pet_schema.dump(pet),
        201,
        {"Location": url_for(".get_pet", pet_id=pet.id, _external=True)},
    )


@bp.get("/pets/<pet_id>")
def get_pet(pet_id):
    """Return one animal (deprecated: list with the status filter instead)."""
    pet = db.session.get(Pet, int(pet_id)) if is_pet_id(pet_id) else None
    if pet is None:
        raise APIError(404, "not_found", f"No animal with id {pet_id}.")
    return pet_schema.dump(pet), 200


@bp.after_request
def announce_deprecation(response):
    """Mark every getPet response deprecated, errors included, as RFC 9745 and RFC 8594 ask."""
    if request.endpoint == "pets.get_pet":
        deprecation = current_app.config["GET_PET_DEPRECATION"]
        response.headers["Deprecation"] = f"@{int(deprecation['since'].timestamp())}"
        response.headers["Sunset"] = format_datetime(deprecation["sunset"], usegmt=True)
        response.headers["Link"] = f'<{deprecation["successor"]}>; rel="successor-version"'
    return response


def is_pet_id(text: str) -> bool:
    # Ids are positive int64 written in ASCII digits; anything else names no animal.
    return text.isascii() and text.isdigit() and len(text) <= 19 and 0 < int(text) <= INT64_MAX


def json_object_body() -> dict:
    """Return the request body parsed as a JSON object, or raise the error that says why not."""
    if request.mimetype != "application/json":
        raise APIError(
            415,
            "unsupported_media_type",
            "Send the body as JSON with 'Content-Type: application/json'.",
        )
    try:
        body = orjson.loads(read_body())
    except orjson.JSONDecodeError as error:
        raise APIError(400, "invalid_json", f"The body is not valid JSON: {error}.") from None
    if not isinstance(body, dict):
        raise APIError(400, "invalid_json", "The body must be a JSON object.")
    return body


def read_body() -> bytes:
    data = request.get_data(cache=False)
    # Werkzeug stops a chunked body (no Content-Length) at the limit without complaint; a body
    # that fills the limit is refused rather than parsed cut short.
    if request.content_length is None and len(data) >= current_app.config["MAX_CONTENT_LENGTH"]:
        raise RequestEntityTooLarge()
    return data


def load(schema, data, context: str) -> dict:
    try:
        return schema.load(data)
    except ValidationError as error:
        fields = ", ".join(sorted(error.messages))
        raise APIError(
            400, "validation_error", f"{context}: {fields}.", errors=error.messages
        ) from None
