"""A throwaway second resource, `widgets`, written as docs/development.rst (Adding a resource)
says: a model, its schemas, its statements and its views, declared and nothing more. No code here
authenticates, limits, scopes idempotency keys, names header components, orders ids, answers a
duplicate or allows a browser's method: the layer does (tests/test_second_resource.py).

Two departures, both because it lives in the tests: its model has a MetaData of its own, since the
app's must stay exactly what the migrations build (tests/test_migrations.py); and its table is made
by make_table(), which does what its migration would (create the table, then keyset.order_ids).
"""

import orjson
import sqlalchemy as sa
from flask import make_response, url_for
from marshmallow import EXCLUDE, Schema, fields, validate
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from animal_store import errors
from animal_store.api import Blueprint, Header
from animal_store.data import keyset, store
from animal_store.data.answers import json_response
from animal_store.data.filters import walk_of
from animal_store.data.models import Int64Id
from animal_store.data.pagination import next_page_link, next_page_query
from animal_store.extensions import db
from animal_store.idempotency import (
    IDEMPOTENT_REPLAYED,
    creation_transaction,
    idempotent,
    remember,
)
from animal_store.schemas import INT64_MAX, Cursor, Int64, QueryInteger


# The model (models.py in a real resource).
class Base(DeclarativeBase):
    metadata = sa.MetaData()


class Widget(Base):
    __tablename__ = "widgets"

    # No identity: on PostgreSQL the keyset trigger takes ids in order (keyset.py).
    id: Mapped[int] = mapped_column(Int64Id, primary_key=True)
    name: Mapped[str] = mapped_column(sa.String(100), unique=True)


TABLE = Widget.__table__


def make_table(connection: sa.Connection) -> None:
    """Do what the resource's migration would: create the table, then order its ids."""
    Base.metadata.create_all(connection)
    keyset.order_ids(connection, TABLE.name)


def drop_table(connection: sa.Connection) -> None:
    """Do what the migration's downgrade would: drop the table, then what ordered its ids."""
    Base.metadata.drop_all(connection)
    keyset.unorder_ids(connection, TABLE.name)


# The wire format (schemas.py).
class WidgetSchema(Schema):
    class Meta:
        unknown = EXCLUDE

    id = Int64(dump_only=True, required=True)
    name = fields.String(required=True, validate=validate.Length(min=1, max=100))


class WidgetQuerySchema(Schema):
    class Meta:
        unknown = EXCLUDE

    limit = QueryInteger(load_default=20, validate=validate.Range(1, 100))
    cursor = Cursor(metadata={"type": "string"})


# The statements (store.py).
WIDGET_ROW = sa.select(TABLE.c.id, TABLE.c.name)
LIST_PAGE = (
    WIDGET_ROW.add_columns(keyset.settled(TABLE))
    .where(TABLE.c.id > sa.bindparam("after"))
    .order_by(TABLE.c.id)
    .limit(sa.bindparam("limit"))
)
WIDGET_BY_ID = WIDGET_ROW.where(TABLE.c.id == sa.bindparam("widget_id"))
INSERT_WIDGET = sa.insert(TABLE).returning(TABLE.c.id)
DELETE_WIDGET = sa.delete(TABLE).where(TABLE.c.id == sa.bindparam("widget_id"))


# The resource (a module like pets.py).
bp = Blueprint("widgets", __name__)
# Ids are positive int64: any other path is 404 before the view runs.
WIDGET_PATH = f"/widgets/<int(min=1, max={INT64_MAX}):widget_id>"

widget_schema = WidgetSchema()
widgets_schema = WidgetSchema(many=True)
widget_query_schema = WidgetQuerySchema()

LOCATION = Header(
    "Location",
    "The absolute URL of the new widget.",
    {"type": "string", "format": "uri"},
    required=True,
)


@bp.route("/widgets", methods=["GET"])
@bp.doc(operationId="listWidgets")
@bp.arguments(widget_query_schema, location="query")
@bp.response(200, widgets_schema, description="A page of widgets.")
def list_widgets(query):
    """List widgets, a page at a time, in ascending id order."""
    limit = query["limit"]
    after = query["cursor"].last_id if "cursor" in query else 0
    rows = store.read_page(LIST_PAGE, {"after": after, "limit": limit + 1}, TABLE)
    shown = keyset.settled_prefix(rows)[:limit]
    response = json_response(orjson.dumps(widgets_schema.dump(shown)))
    # A row past the page, or one not settled yet: the walk goes on after the last one shown.
    if len(rows) > len(shown):
        last_id = shown[-1]["id"] if shown else after
        # A walk no filter narrows (widgets have none).
        response.headers["Link"] = next_page_link(next_page_query(last_id, limit, walk_of({})))
    return response


@bp.route("/widgets", methods=["POST"])
@bp.doc(operationId="createWidget")
@bp.errors(errors.ALREADY_EXISTS)
@bp.arguments(widget_schema)
@bp.response(
    201,
    widget_schema,
    description="The new widget.",
    headers={"Location": LOCATION, "Idempotent-Replayed": IDEMPOTENT_REPLAYED},
)
@idempotent
def create_widget(widget):
    """Add a widget; its name is unique."""
    with creation_transaction() as connection:
        widget["id"] = connection.execute(INSERT_WIDGET, widget).scalar_one()
        location = url_for(".get_widget", widget_id=widget["id"], _external=True)
        response = make_response(widget_schema.dump(widget), 201, {"Location": location})
        remember(connection, response)
    return response


@bp.route(WIDGET_PATH, methods=["GET"])
@bp.doc(operationId="getWidget")
@bp.errors(errors.NOT_FOUND)
@bp.response(200, widget_schema, description="The widget.")
def get_widget(widget_id):
    """Get a widget."""
    rows = store.read(WIDGET_BY_ID, {"widget_id": widget_id})
    if not rows:
        raise errors.NOT_FOUND(path=f"/v1/widgets/{widget_id}")
    return rows[0]


@bp.route(WIDGET_PATH, methods=["DELETE"])
@bp.doc(operationId="deleteWidget")
@bp.errors(errors.NOT_FOUND)
@bp.response(204, description="Deleted.")
def delete_widget(widget_id):
    """Delete a widget: a method pets do not have, which browsers may then use too."""
    deleted = db.session.execute(DELETE_WIDGET, {"widget_id": widget_id}).rowcount
    if deleted != 1:
        raise errors.NOT_FOUND(path=f"/v1/widgets/{widget_id}")
    db.session.commit()
    return ""
