# flask-smorest ships no type hints and no stub package exists: these are the parts the API layer
# (animal_store/api/) and the resources use, as flask-smorest 0.47 defines them.
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, TypeVar

import flask
from apispec import APISpec
from apispec.ext.marshmallow import MarshmallowPlugin
from flask_smorest.spec.plugins import FlaskPlugin
from marshmallow import Schema
from webargs.flaskparser import FlaskParser

_View = TypeVar("_View", bound=Callable[..., Any])
# What a view's declarations turn it into: flask-smorest wraps it in a function that loads its
# arguments or dumps its answer.
_Wrap = Callable[[Callable[..., Any]], Callable[..., Any]]
_Schema = type[Schema] | Schema

class Blueprint(flask.Blueprint):
    ARGUMENTS_PARSER: ClassVar[FlaskParser]
    # {endpoint: {method: {feature: what its decorator declared}, "parameters": [...]}}
    _docs: dict[str, dict[str, Any]]
    _prepare_doc_cbks: list[Callable[..., dict[str, Any]]]
    def __init__(
        self,
        name: str,
        import_name: str,
        *,
        description: str = ...,
        url_prefix: str | None = ...,
        **kwargs: Any,
    ) -> None: ...
    def route(
        self,
        rule: str,
        *,
        parameters: list[str | dict[str, Any]] | None = ...,
        tags: list[str] | None = ...,
        **options: Any,
    ) -> Callable[[_View], _View]: ...
    def arguments(
        self,
        schema: _Schema,
        *,
        location: str = ...,
        content_type: str | None = ...,
        required: bool = ...,
        description: str | None = ...,
        example: Any = ...,
        examples: Mapping[str, Any] | None = ...,
        **kwargs: Any,
    ) -> _Wrap: ...
    def response(
        self,
        status_code: int | str,
        schema: _Schema | None = ...,
        *,
        content_type: str | None = ...,
        description: str | None = ...,
        example: Any = ...,
        examples: Mapping[str, Any] | None = ...,
        headers: Mapping[str, Any] | None = ...,
    ) -> _Wrap: ...
    def alt_response(
        self,
        status_code: int | str,
        response: str | None = ...,
        *,
        schema: _Schema | None = ...,
        content_type: str | None = ...,
        description: str | None = ...,
        example: Any = ...,
        examples: Mapping[str, Any] | None = ...,
        headers: Mapping[str, Any] | None = ...,
        success: bool = ...,
    ) -> _Wrap: ...
    @staticmethod
    def doc(**kwargs: Any) -> _Wrap: ...

class Api:
    DEFAULT_ERROR_RESPONSE_NAME: ClassVar[str | None]
    ERROR_SCHEMA: ClassVar[type[Schema]]
    _app: flask.Flask
    spec: APISpec
    flask_plugin: FlaskPlugin
    ma_plugin: MarshmallowPlugin
    def __init__(
        self,
        app: flask.Flask | None = ...,
        *,
        spec_kwargs: Mapping[str, Any] | None = ...,
        config_prefix: str = ...,
    ) -> None: ...
    def register_blueprint(
        self,
        blp: Blueprint,
        *,
        parameters: list[str | dict[str, Any]] | None = ...,
        **options: Any,
    ) -> None: ...
    def register_field(self, field: type[Any], *args: Any) -> None: ...
    def _register_error_handlers(self) -> None: ...
    def _register_pagination_header(self) -> None: ...
