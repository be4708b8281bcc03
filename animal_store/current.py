"""Flask's `request` and `g` as the proxies they are, for the steps every request runs.

Each use of a proxy looks its object up in the context anew; a step that reads several fields
looks the object up once (`REQUEST._get_current_object()`) and reads them from it. Flask types
the proxies as the objects they stand for, which hides that method from the checker.
"""

from typing import cast

from flask import Request, g, request
from flask.ctx import _AppCtxGlobals
from werkzeug.local import LocalProxy

REQUEST = cast("LocalProxy[Request]", request)
G = cast("LocalProxy[_AppCtxGlobals]", g)
