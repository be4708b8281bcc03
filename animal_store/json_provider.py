"""Flask's JSON through orjson: faster than the standard library, and strict where it should be."""

import orjson
from flask.json.provider import JSONProvider


class OrjsonProvider(JSONProvider):
    def dumps(self, obj, **kwargs) -> str:
        return orjson.dumps(obj).decode()

    def loads(self, s, **kwargs):
        return orjson.loads(s)

    def response(self, *args, **kwargs):
        body = orjson.dumps(self._prepare_response_obj(args, kwargs))
        return self._app.response_class(body, mimetype="application/json")
