"""What listPets may be filtered by: one declaration, from which everything else follows.

Each filter is a query parameter matched for equality against the column of the same name. The
cursor's format and its validation (pagination.py), the select of each combination of filters
(store.py), the query schema and so the served document (schemas.py), the next page's link
(pagination.py) and the kept answers' key (pets.py) all read LIST_FILTERS; nothing else names a
filter.

A walk is the values of the filters of one list request, in LIST_FILTERS' order (None: not
filtered by it). The cursor holds it in that order, so a filter is only ever appended: a cursor
made before it existed decodes as a walk without it (pagination.py).
"""

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any, cast

import sqlalchemy as sa

from animal_store.data.models import Pet

Walk = tuple[str | None, ...]


@dataclass(frozen=True)
class ListFilter:
    """A query parameter that keeps the animals whose column `name` equals its value."""

    name: str
    column: sa.ColumnElement[Any]

    @cached_property
    def choices(self) -> tuple[str, ...]:
        # The values the column may hold (its Enum), which the cursor carries as they are.
        return tuple(cast("sa.Enum", self.column.type).enums)


PETS = cast("sa.Table", Pet.__table__)
LIST_FILTERS = (ListFilter("status", PETS.c.status),)
# The filters the next release serves, refused here (400) where an unknown parameter is ignored:
# during that release's rollout a worker of this one then never answers a filtered request with
# the whole list (docs/development.rst, Adding a field or a filter).
NEXT_RELEASE_FILTERS: tuple[str, ...] = ()


# Their names, in order.
LIST_FILTER_NAMES = tuple(list_filter.name for list_filter in LIST_FILTERS)


def walk_of(values: Mapping[str, Any]) -> Walk:
    """Return the walk a request's loaded query (or any mapping of filter names) asks for."""
    return tuple(map(values.get, LIST_FILTER_NAMES))
