"""The wire format: what clients may send and what they get back."""

import re
import unicodedata
from collections.abc import Mapping
from typing import Any, NotRequired, TypedDict

from marshmallow import (
    EXCLUDE,
    Schema,
    ValidationError,
    fields,
    post_dump,
    pre_load,
    validate,
    validates_schema,
)

from animal_store.data.filters import LIST_FILTERS, NEXT_RELEASE_FILTERS, walk_of
from animal_store.data.models import PET_STATUSES
from animal_store.data.pagination import CURSOR_SYNTAX, Position, decode_cursor

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# The least id: the database gives every id (PostgreSQL's sequences and SQLite's rowid count
# from 1) and no client sends one, so an id, in a body or a path, is a positive int64.
ID_MIN = 1


class Int64(fields.Integer):
    """A JSON integer within int64 (from `minimum` up): no strings, floats or booleans, nothing
    the database refuses."""

    def __init__(self, minimum: int = INT64_MIN, **kwargs: Any) -> None:
        super().__init__(strict=True, validate=validate.Range(minimum, INT64_MAX), **kwargs)


class QueryInteger(fields.Integer):
    """An integer written as ASCII digits only, as query strings should carry it."""

    default_error_messages = {"invalid": "Must be a whole number written with the digits 0-9."}

    def _deserialize(
        self, value: Any, attr: str | None, data: Mapping[str, Any] | None, **kwargs: Any
    ) -> int:
        if not isinstance(value, str) or not re.fullmatch(r"[0-9]{1,18}", value):
            raise self.make_error("invalid")
        return int(value)


# validate_name's rule as a regular expression, for the OpenAPI document: at least one character
# that is neither whitespace nor a control character (C0, DEL, C1), and no control character
# anywhere. Spelled with explicit ranges, not \s or \p{Cc}, so that Python's re, ECMA-262 and
# Rust's regex (which JSON Schema tools use) all read it the same way; the whitespace listed is
# what str.strip() removes, control characters aside. Lone surrogates, which validate_name also
# refuses, cannot be written in a pattern Rust's regex accepts, and never arrive: the JSON parser
# refuses them first.
NAME_PATTERN = (
    r"^[^\u0000-\u001f\u007f-\u009f]*"
    r"[^\u0000-\u0020\u007f-\u00a0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]"
    r"[^\u0000-\u001f\u007f-\u009f]*$"
)


class Cursor(fields.Field[Position]):
    """The opaque `cursor` query parameter, loaded as the walk Position it names."""

    default_error_messages = {
        "invalid": 'Not a cursor from this service; follow the URL of the Link rel="next" header.',
    }

    def _deserialize(
        self, value: Any, attr: str | None, data: Mapping[str, Any] | None, **kwargs: Any
    ) -> Position:
        try:
            return decode_cursor(value)
        except ValueError:
            raise self.make_error("invalid") from None


class EnumField(fields.String):
    """A string from a fixed set, shown in the document as one schema component of its own.

    One component, referred to wherever the field appears, so that a client generated from the
    document has one type for it, not one per place. The choices are checked here rather than by
    a OneOf validator, which the document would spell out inline again.
    """

    component: str
    choices: tuple[str, ...]
    description: str
    default_error_messages = {"one_of": "Must be one of: {choices}."}

    def _deserialize(
        self, value: Any, attr: str | None, data: Mapping[str, Any] | None, **kwargs: Any
    ) -> str:
        text = super()._deserialize(value, attr, data, **kwargs)
        if text not in self.choices:
            raise self.make_error("one_of", choices=", ".join(self.choices))
        return text

    @classmethod
    def component_schema(cls) -> dict[str, Any]:
        return {"type": "string", "enum": list(cls.choices), "description": cls.description}


class PetStatus(EnumField):
    component = "PetStatus"
    choices = PET_STATUSES
    description = "Whether the animal can be had: available, pending (reserved) or sold."


def validate_name(name: str) -> None:
    if not name.strip():
        raise ValidationError("Must not be blank.")
    # Control characters (NUL above all, which PostgreSQL cannot store) have no place in a name.
    if any(unicodedata.category(char) in ("Cc", "Cs") for char in name):
        raise ValidationError("Must not contain control characters.")


class PetSchema(Schema):
    id = Int64(
        ID_MIN,
        dump_only=True,
        required=True,
        metadata={"description": "Assigned by the store.", "example": 1},
    )
    name = fields.String(
        required=True,
        validate=[validate.Length(min=1, max=255), validate_name],
        metadata={
            "pattern": NAME_PATTERN,
            "description": "1 to 255 characters, not only whitespace, no control characters.",
            "example": "Rex",
        },
    )
    category_id = Int64(
        required=True,
        data_key="categoryId",
        metadata={
            "description": "A JSON integer written without a fraction or exponent: "
            "1.0 and 1e3 are refused (400) although JSON Schema's integer type admits them.",
            "example": 1,
        },
    )
    status = PetStatus(
        metadata={"description": "Left out when the animal has none; null is refused."}
    )

    @post_dump
    def drop_missing_status(self, data: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
        # An animal without a status leaves the field out; the contract has no null status.
        if data.get("status") is None:
            data.pop("status", None)
        return data


class NewPetSchema(PetSchema):
    """What a client sends to create an animal: everything but the id the store assigns."""

    class Meta:
        exclude = ("id",)


class ListQuery(TypedDict):
    """listPets' query as ListQuerySchema loads it: a filter's value under its name, if given."""

    limit: int
    status: NotRequired[str]
    cursor: NotRequired[Position]


FILTER_NAMES = ", ".join(f"`{list_filter.name}`" for list_filter in LIST_FILTERS)


class ListQueryBase(Schema):
    """listPets' query but the filters and the cursor, which ListQuerySchema adds in this order."""

    class Meta:
        unknown = EXCLUDE

    limit = QueryInteger(load_default=20, validate=validate.Range(1, 100))

    @validates_schema
    def cursor_matches_filters(self, data: dict[str, Any], **kwargs: Any) -> None:
        # A cursor continues one walk; with other filters its position would skip animals.
        if "cursor" in data and data["cursor"].walk != walk_of(data):
            raise ValidationError(
                f"This cursor belongs to a walk with other filters; keep the {FILTER_NAMES} "
                'of the Link rel="next" URL.',
                "cursor",
            )


class RefusingNextReleaseFilters(ListQueryBase):
    """listPets' query in a release whose next one serves more filters: those are refused (400)
    where an unknown parameter is ignored."""

    next_release_filters = NEXT_RELEASE_FILTERS

    @pre_load
    def refuse_next_release_filters(self, data: Mapping[str, Any], **kwargs: Any) -> Any:
        for name in self.next_release_filters:
            if name in data:
                raise ValidationError(
                    "Not a filter of this release yet; the next one serves it.", name
                )
        return data


# Only a release with a filter to come pays for the hook, which marshmallow dispatches on every
# list request whatever it does.
QUERY_BASE = RefusingNextReleaseFilters if NEXT_RELEASE_FILTERS else ListQueryBase
# A filter's parameter takes the values of the animal's field it matches, in the field's own type
# (one component in the document: PetStatus), without what the body says of the field.
ListQuerySchema = QUERY_BASE.from_dict(
    {
        **{
            list_filter.name: type(PetSchema().fields[list_filter.name])()
            for list_filter in LIST_FILTERS
        },
        "cursor": Cursor(
            metadata={
                "type": "string",
                "pattern": f"^{CURSOR_SYNTAX}$",
                "description": "Opaque: where the next page starts, taken from the "
                '`Link: rel="next"` URL of the page before. A garbled cursor, or one from a walk '
                f"with other filters ({FILTER_NAMES}), is 400.",
            }
        ),
    },
    name="ListQuerySchema",
)


class ErrorSchema(Schema):
    """Every error body: a stable code for programs, a message for people, and the HTTP status."""

    code = fields.String(required=True, metadata={"description": "Machine-readable, stable."})
    message = fields.String(required=True, metadata={"description": "For people; names the field."})
    status = fields.Integer(required=True, metadata={"description": "Repeats the HTTP status."})
    errors = fields.Dict(
        keys=fields.String(),
        values=fields.List(fields.String()),
        metadata={"description": "Validation errors only: each field or parameter's messages."},
    )
