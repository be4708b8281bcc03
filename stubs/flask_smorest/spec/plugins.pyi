import re
from typing import Any

from apispec import APISpec, BasePlugin
from werkzeug.routing import Rule

RE_URL: re.Pattern[str]

class FlaskPlugin(BasePlugin):
    def init_spec(self, spec: APISpec) -> None: ...
    # A staticmethod in flask-smorest, which calls it through the instance (path_helper): a
    # method here, so that a subclass may read its own settings in it.
    def flaskpath2openapi(self, path: str) -> str: ...
    def rule_to_params(self, rule: Rule) -> list[dict[str, Any]]: ...
