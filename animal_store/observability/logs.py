"""Structured logs: JSON lines on stdout, one per request at least, each with its request ID."""

import logging
import math
import re
import sys
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any, TextIO
from urllib.parse import unquote_plus

import orjson
from flask import Flask, Response
from flask.logging import default_handler

from animal_store.current import REQUEST, G
from animal_store.extensions import settings
from animal_store.http.request_id import current_request_id

# The app's access log: one line per request, at INFO ("animal_store" is the app's own logger).
REQUESTS = logging.getLogger("animal_store.request")
# The value of a query parameter the request's operation does not declare, as the log writes it:
# anything may be there, an API key sent as ?api_key= or ?access_token= included.
MASKED = "***"


class Seconds:
    """The second the last line was written in, as ISO 8601 text, so that a line's time costs
    its milliseconds only: a datetime made and formatted for each line was half its cost."""

    def __init__(self) -> None:
        self.last: tuple[int, str] = (0, "")

    def utc_time(self, created: float) -> str:
        """`created` (Unix seconds) as datetime's isoformat(timespec="milliseconds") gives it in
        UTC: split and rounded to the microsecond as datetime.fromtimestamp does, then cut."""
        fraction, whole = math.modf(created)
        second, micros = divmod(int(whole) * 1_000_000 + round(fraction * 1e6), 1_000_000)
        last = self.last  # read once: another thread may replace it meanwhile
        if last[0] != second:
            text = datetime.fromtimestamp(second, UTC).isoformat().removesuffix("+00:00")
            last = self.last = (second, text)
        return f"{last[1]}.{micros // 1000:03d}+00:00"


utc_time = Seconds().utc_time


def json_line(
    created: float, level: str, logger: str, message: str, fields: Mapping[str, Any]
) -> str:
    """Return one log line: a JSON object with the time, level, logger, message, the request ID
    of the request being served, and `fields`."""
    line: dict[str, Any] = {
        "time": utc_time(created),
        "level": level,
        "logger": logger,
        "message": message,
    }
    request_id = current_request_id()
    if request_id:
        line["request_id"] = request_id
    line.update(fields)
    return orjson.dumps(line, default=str).decode()


class JsonFormatter(logging.Formatter):
    """Format a record as one JSON object on one line; gunicorn's logconfig uses it too."""

    def format(self, record: logging.LogRecord) -> str:
        fields = getattr(record, "fields", {})
        if record.exc_info:
            fields = {**fields, "exception": self.formatException(record.exc_info)}
        return json_line(record.created, record.levelname, record.name, record.getMessage(), fields)


class StdoutHandler(logging.StreamHandler[TextIO]):
    """Write to sys.stdout as it is at each record, so redirected output receives the lines."""

    def __init__(self) -> None:
        super().__init__(sys.stdout)

    @property
    def stream(self) -> TextIO:
        return sys.stdout

    @stream.setter
    def stream(self, _value: TextIO) -> None:
        pass


# The app's one handler: every app of the process shares it (tests make many).
STDOUT = StdoutHandler()
STDOUT.setFormatter(JsonFormatter())


# Werkzeug's format for the development server's line per request (serving.py, log_request).
WERKZEUG_REQUEST_LINE = '"%s" %s %s'
# The terminal colours Werkzeug puts in its lines.
ANSI_STYLE = re.compile(r"\x1b\[[0-9;]*m")


class DevelopmentServerFormatter(logging.Formatter):
    """The development server's own lines, as Werkzeug writes them but without colour codes,
    which a file or a pager shows as noise."""

    def format(self, record: logging.LogRecord) -> str:
        return ANSI_STYLE.sub("", super().format(record))


def not_a_request_line(record: logging.LogRecord) -> bool:
    # The app writes its own line per request, with the request ID: Werkzeug's would be a second.
    return not (isinstance(record.msg, str) and record.msg.endswith(WERKZEUG_REQUEST_LINE))


# The development server's log (the "werkzeug" logger): its start, its warnings and errors, on
# stderr as before; Werkzeug adds a handler of its own only to a logger that has none.
DEVELOPMENT_SERVER = logging.StreamHandler()
DEVELOPMENT_SERVER.setFormatter(DevelopmentServerFormatter())
DEVELOPMENT_SERVER.addFilter(not_a_request_line)


def configure_logging(app: Flask) -> None:
    """Send the app's log records to stdout as JSON lines at LOG_LEVEL."""
    logger = logging.getLogger(app.name)
    logger.removeHandler(default_handler)
    if STDOUT not in logger.handlers:
        logger.addHandler(STDOUT)
    logger.setLevel(settings(app).LOG_LEVEL)
    # The one handler above writes each line; the root logger (gunicorn's) would write it twice.
    logger.propagate = False
    development_server = logging.getLogger("werkzeug")
    if DEVELOPMENT_SERVER not in development_server.handlers:
        development_server.addHandler(DEVELOPMENT_SERVER)
    # Alone: `quickstart` migrates in process first, and Alembic's logging configuration gives
    # the root logger a handler that would write each line again, request lines and colours too.
    development_server.propagate = False


def start_timer() -> None:
    G._get_current_object().request_started = time.perf_counter()


def request_log(declared: Mapping[str, frozenset[str]]) -> Callable[[Response], None]:
    """Return the step that writes each request's line, the app's access log (at INFO);
    `declared` names, by endpoint, the query parameters whose values it writes as sent."""

    def log_request(response: Response) -> None:
        if not REQUESTS.isEnabledFor(logging.INFO):
            return
        fields = request_fields(response, declared)
        if only_stdout_listens():
            # The line the handler would write, written as one string: logging's record,
            # handler lock and formatter calls were a sixth of a list request's CPU in process
            # (docs/benchmarks.rst).
            stream = sys.stdout
            stream.write(json_line(time.time(), "INFO", REQUESTS.name, "request", fields) + "\n")
            stream.flush()
        else:
            REQUESTS.info("request", extra={"fields": fields})

    return log_request


def only_stdout_listens() -> bool:
    # True while logging is as configure_logging left it. An operator who adds a handler or a
    # filter anywhere on the way gets every line through logging, as any other record.
    app_logger = REQUESTS.parent
    return (
        REQUESTS.propagate
        and not REQUESTS.handlers
        and not REQUESTS.filters
        and app_logger is not None
        and app_logger.handlers == [STDOUT]
        and not app_logger.filters
        and not app_logger.propagate
        and not STDOUT.filters
        and STDOUT.level <= logging.INFO
    )


def request_fields(response: Response, declared: Mapping[str, frozenset[str]]) -> dict[str, Any]:
    # The request and g looked up once each, not through their proxies at every field.
    served, context = REQUEST._get_current_object(), G._get_current_object()
    started = context.get("request_started")
    api_key = context.get("api_key")
    fields = {
        "method": served.method,
        "path": served.path,
        "status": response.status_code,
        "duration_ms": round((time.perf_counter() - started) * 1000, 2) if started else None,
        "remote_addr": served.remote_addr,
        # Which key, by its name and visible prefix; never the key or the Authorization header.
        "api_key_name": api_key.name if api_key else None,
        "api_key_prefix": context.get("api_key_prefix"),
    }
    if served.query_string:
        query = served.query_string.decode("latin-1")
        fields["query"] = masked_query(query, declared.get(served.endpoint or "", frozenset()))
    return fields


def masked_query(query: str, declared: frozenset[str]) -> str:
    """Return the query as sent, but with the value of each parameter not `declared` written
    ***: its name stays, so an operator sees what was sent. A part without "=" that is not a
    declared name is written *** whole: it may be a key pasted alone (?ask_...)."""
    parts = []
    for part in query.split("&"):
        name, equals, _ = part.partition("=")
        # (Decoded only where it is no declared name as sent: a list's query never is.)
        if not part or name in declared or unquote_plus(name) in declared:
            parts.append(part)
        else:
            parts.append(f"{name}={MASKED}" if equals else MASKED)
    return "&".join(parts)
