"""The wire format: what clients may send and what they get back."""

import re
import unicodedata

from marshmallow import EXCLUDE, Schema, ValidationError, fields, post_dump, validate

from animal_store.models import PET_STATUSES

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class Int64(fields.Integer):
    """A JSON integer within int64: no strings, floats or booleans, nothing the database refuses."""

    def __init__(self, **kwargs):
        super().__init__(strict=True, validate=validate.Range(INT64_MIN, INT64_MAX), **kwargs)


class QueryInteger(fields.Integer):
    """An integer written as ASCII digits only, as query strings should carry it."""

    default_error_messages = {"invalid": "Must be a whole number written with the digits 0-9."}

    def _deserialize(self, value, attr, data, **kwargs):
        if not isinstance(value, str) or not re.fullmatch(r"[0-9]{1,18}", value):
            raise self.make_error("invalid")
        return int(value)


def validate_name(name: str) -> None:
    if not name.strip():
        raise ValidationError("Must not be blank.")
    # Control characters (NUL above all, which PostgreSQL cannot store) have no place in a name.
    if any(unicodedata.category(char) in ("Cc", "Cs") for char in name):
        raise ValidationError("Must not contain control characters.")


class PetSchema(Schema):
    id = Int64(dump_only=True)
    name = fields.String(required=True, validate=[validate.Length(min=1, max=255), validate_name])
    category_id = Int64(required=True, data_key="categoryId")
    status = fields.String(validate=validate.OneOf(PET_STATUSES))

    @post_dump
    def drop_missing_status(self, data, **kwargs):
        # An animal without a status leaves the field out; the contract has no null status.
        if data.get("status") is None:
            data.pop("status", None)
        return data


class NewPetSchema(PetSchema):
    """What a client sends to create an animal: everything but the id the store assigns."""

    class Meta:
        exclude = ("id",)


class ListQuerySchema(Schema):
    class Meta:
        unknown = EXCLUDE

    limit = QueryInteger(load_default=20, validate=validate.Range(1, 100))
    status = fields.String(validate=validate.OneOf(PET_STATUSES))
