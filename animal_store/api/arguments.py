"""The parser of what views take (webargs'), with the API's answers and a memo of queries."""

import threading
from collections.abc import Mapping
from typing import Any, NoReturn, cast

from cachetools import LRUCache
from flask import Request
from marshmallow import Schema, ValidationError
from webargs._types import ArgMap  # what a parser takes; webargs names it only there
from webargs.flaskparser import FlaskParser

from animal_store import errors
from animal_store.current import REQUEST
from animal_store.http.body import json_object_body


class ArgumentsParser(FlaskParser):
    """webargs' parser with the API's answers: 400 validation_error, and the JSON body rules."""

    DEFAULT_VALIDATION_STATUS = 400
    LOCATION_NAMES = {"query": "query parameter", "json": "request body", "headers": "header"}
    # Query strings whose arguments a worker remembers, least recently used dropped first.
    KNOWN_QUERIES = 1024

    def __init__(self) -> None:
        super().__init__()
        # {(id of the schema, query string): its arguments as the schema loaded them}
        self.queries: LRUCache[tuple[int, bytes], dict[str, Any]] = LRUCache(self.KNOWN_QUERIES)
        # The development server serves each request on a thread of its own.
        self.lock = threading.Lock()

    def parse(
        self,
        argmap: ArgMap[Request],
        req: Request | None = None,
        *,
        location: str | None = None,
        **kwargs: Any,
    ) -> Any:
        """Parse as webargs does; a query's arguments, a function of its text alone, only the
        first time a worker sees that text (a walk's pages and a client's polls repeat theirs)."""
        if location != "query":
            return super().parse(argmap, req, location=location, **kwargs)
        served = req or REQUEST._get_current_object()
        key = (id(argmap), served.query_string)  # a schema lives as long as its view
        with self.lock:
            parsed = self.queries.get(key)
        if parsed is None:  # not remembered, or refused: a 400 is never remembered
            parsed = super().parse(argmap, req, location=location, **kwargs)
            with self.lock:
                self.queries[key] = parsed
        return dict(parsed)  # the view's own copy

    def load_querystring(self, req: Request, schema: Schema) -> Any:
        # The query as Werkzeug parsed it, whose get() is a parameter's first value: what a
        # schema of single-valued fields reads, without webargs' per-request proxy around it.
        return req.args

    def load_json(self, req: Request, schema: Schema) -> Any:
        return json_object_body()

    def handle_error(
        self,
        error: ValidationError,
        req: Request,
        schema: Schema,
        *,
        error_status_code: int | None,
        error_headers: Mapping[str, str] | None,
    ) -> NoReturn:
        # webargs files the messages under the location they come from: always a dict.
        ((location, messages),) = cast(dict[str, Any], error.messages).items()
        raise errors.VALIDATION_ERROR(
            errors=messages,
            where=self.LOCATION_NAMES[location],
            fields=", ".join(sorted(messages)),
        )
