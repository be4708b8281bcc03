"""gunicorn's own log: its logger without the access line, and its lines as JSON.

config/gunicorn.conf.py names both (logger_class, logconfig_dict). gunicorn's master loads them,
so the standard library and gunicorn only; like the worker class, this module is read anew from
disk on a reload (serving/worker.py's Worker.setup()), but gunicorn keeps the logger it made at
boot: a change to Logger takes a restart, one to JsonFormatter a reload.
"""

import json
import logging
from collections.abc import MutableMapping
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from gunicorn import glogging

if TYPE_CHECKING:
    from gunicorn.http import Request
    from gunicorn.http.wsgi import Response


class Logger(glogging.Logger):
    """gunicorn's logger without its access line. `accesslog = None` is not enough: given a
    logging config (config/gunicorn.conf.py's logconfig_dict), gunicorn builds the line's fields
    for every request anyway, a tenth of a worker's CPU on a list request (docs/benchmarks.rst)."""

    def access(
        self,
        resp: "Response",
        req: "Request",
        environ: MutableMapping[str, Any],
        request_time: timedelta,
    ) -> None:
        pass


class JsonFormatter(logging.Formatter):
    """gunicorn's own lines (boot, reloads, workers started and stopped) as JSON, with the keys
    of the app's (observability/logs.py), which the master does not import."""

    def format(self, record: logging.LogRecord) -> str:
        line = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            **getattr(record, "fields", {}),
        }
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False, separators=(",", ":"), default=str)
