import re
from typing import Any

from apispec import APISpec, BasePlugin
from werkzeug.routing import Rule

RE_URL: re.Pattern[str]

class FlaskPlugin(BasePlugin):
    def init_spec(self, spec: APISpec) -> None: ...
    @staticmethod
    def flaskpath2openapi(path: str) -> str: ...
    def rule_to_params(self, rule: Rule) -> list[dict[str, Any]]: ...
