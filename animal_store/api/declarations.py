"""What views declare of their contract, beside flask-smorest's declarations, and the Blueprint
resources are made of."""

from collections.abc import Callable, Mapping
from copy import deepcopy
from typing import Any, Protocol, TypedDict, TypeVar, cast

import flask
import flask.sansio.blueprints
import flask_smorest
import flask_smorest.utils
from marshmallow import Schema

from animal_store import errors
from animal_store.api.arguments import ArgumentsParser
from animal_store.http.body import BODY_ERRORS

View = TypeVar("View", bound=Callable[..., Any])


class Declarations(TypedDict, total=False):
    """What has been declared of a view, as flask-smorest keeps it on the function (`_apidoc`):
    its own entries (OpenAPI fragments, dict[str, Any] as apispec has them) and ours."""

    # flask-smorest's: doc(), arguments() and response()/alt_response().
    manual_doc: dict[str, Any]
    arguments: dict[str, Any]
    response: dict[str, Any]
    # Ours: errors(), deprecated() (the setting's name) and public.
    errors: list[errors.ErrorKind]
    deprecation: str
    public: bool


class Documented(Protocol):
    """A view as flask-smorest (no type hints) documents it: its declarations are an attribute
    of the function."""

    _apidoc: Declarations


class OperationDoc(Declarations, total=False):
    """What flask-smorest keeps of an operation (`Blueprint._docs[endpoint][method]`) and hands
    to the document hook: its view's declarations, its docstring parsed, and its resource's
    name (register_blueprint)."""

    docstring: dict[str, Any]
    resource: str


class Blueprint(flask_smorest.Blueprint):
    """A flask-smorest Blueprint that also declares errors and deprecation, and nests resources."""

    ARGUMENTS_PARSER = ArgumentsParser()

    @staticmethod
    def errors(*kinds: errors.ErrorKind) -> Callable[[View], View]:
        """Declare the kinds of the catalogue this view answers, besides the layer's own."""

        def decorator(view: View) -> View:
            return declare_errors(view, *kinds)

        return decorator

    def arguments(
        self, schema: Schema | type[Schema], *, location: str = "json", **kwargs: Any
    ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """flask-smorest's arguments, declaring the errors that loading them can answer."""
        load = super().arguments(schema, location=location, **kwargs)
        kinds = (errors.VALIDATION_ERROR, *(BODY_ERRORS if location == "json" else ()))
        return lambda view: declare_errors(load(view), *kinds)

    @staticmethod
    def doc(**kwargs: Any) -> Callable[[View], View]:
        """flask-smorest's doc, as a declaration only: no wrapper around the view per request."""

        def decorator(view: View) -> View:
            manual = view_doc(view).get("manual_doc", {})
            return declare(
                view, "manual_doc", flask_smorest.utils.deepupdate(deepcopy(manual), kwargs)
            )

        return decorator

    @staticmethod
    def deprecated(setting: str) -> Callable[[View], View]:
        """Declare the view deprecated; app.config[setting] has its since, sunset and successor."""

        def decorator(view: View) -> View:
            return declare(view, "deprecation", setting)

        return decorator

    def register_blueprint(
        self, blueprint: flask.sansio.blueprints.Blueprint, **options: Any
    ) -> None:
        """Nest a resource; its operations are tagged with its name in the document."""
        name = options.get("name", blueprint.name)
        for endpoint_doc in getattr(blueprint, "_docs", {}).values():
            for method_doc in endpoint_doc.values():
                if isinstance(method_doc, dict):
                    # For the document hook, which names components after their resource.
                    method_doc["resource"] = name
                    if method_doc.get("tags") is None:
                        method_doc["tags"] = [name]
        if not isinstance(blueprint, flask_smorest.Blueprint):
            # A plain Flask blueprint (the document and docs page): served, not documented.
            flask.Blueprint.register_blueprint(self, blueprint, **options)
        else:
            super().register_blueprint(blueprint, **options)


def view_doc(view: Callable[..., Any]) -> Declarations:
    """Return what has been declared of a view: flask-smorest's entries and ours."""
    declared: Declarations = getattr(view, "_apidoc", Declarations())
    return declared


def declare(view: View, key: str, value: object) -> View:
    """Add a declaration to a view, beside flask-smorest's, and return the view.

    No wrapper, so a declaration costs nothing per request. A copy, as flask-smorest makes: a
    wrapper shares its wrapped function's declarations until it declares something of its own.
    """
    declared = cast(Declarations, {**deepcopy(view_doc(view)), key: value})
    cast(Documented, view)._apidoc = declared
    return view


def declare_errors(view: View, *kinds: errors.ErrorKind) -> View:
    return declare(view, "errors", [*view_doc(view).get("errors", []), *kinds])


def declare_parameter(view: View, parameter: Mapping[str, Any]) -> View:
    """Declare a request parameter the view reads itself (a header), beside its arguments."""
    arguments = deepcopy(view_doc(view).get("arguments", {}))
    arguments.setdefault("parameters", []).append(parameter)
    return declare(view, "arguments", arguments)


def declare_response(view: View, status: int, response: Mapping[str, Any]) -> View:
    """Declare (part of) an answer of the view: merged with what others declare for the status."""
    answers = deepcopy(view_doc(view).get("response", {}))
    answers.setdefault("responses", {}).setdefault(status, []).append(
        {"content_type": None, **response}
    )
    return declare(view, "response", answers)


def public(view: View) -> View:
    """Mark a view of the layer as open to requests without an API key."""
    return declare(view, "public", True)
