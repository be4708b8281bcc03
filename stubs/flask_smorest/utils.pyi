from collections.abc import Mapping
from typing import Any

def deepupdate(original: dict[str, Any], update: Mapping[str, Any]) -> dict[str, Any]: ...
