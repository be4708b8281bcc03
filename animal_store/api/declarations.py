"""What views declare of their contract, beside flask-smorest's declarations, and the Blueprint
resources are made of."""

from copy import deepcopy

import flask
import flask_smorest
import flask_smorest.utils

from animal_store import errors
from animal_store.api.arguments import ArgumentsParser
from animal_store.body import BODY_ERRORS


class Blueprint(flask_smorest.Blueprint):
    """A flask-smorest Blueprint that also declares errors and deprecation, and nests resources."""

    ARGUMENTS_PARSER = ArgumentsParser()

    @staticmethod
    def errors(*kinds: errors.ErrorKind):
        """Declare the kinds of the catalogue this view answers, besides the layer's own."""

        def decorator(view):
            return declare_errors(view, *kinds)

        return decorator

    def arguments(self, schema, *, location="json", **kwargs):
        """flask-smorest's arguments, declaring the errors that loading them can answer."""
        load = super().arguments(schema, location=location, **kwargs)
        kinds = (errors.VALIDATION_ERROR, *(BODY_ERRORS if location == "json" else ()))
        return lambda view: declare_errors(load(view), *kinds)

    @staticmethod
    def doc(**kwargs):
        """flask-smorest's doc, as a declaration only: no wrapper around the view per request."""

        def decorator(view):
            manual = view_doc(view).get("manual_doc", {})
            return declare(
                view, "manual_doc", flask_smorest.utils.deepupdate(deepcopy(manual), kwargs)
            )

        return decorator

    @staticmethod
    def deprecated(setting: str):
        """Declare the view deprecated; app.config[setting] has its since, sunset and successor."""

        def decorator(view):
            return declare(view, "deprecation", setting)

        return decorator

    def register_blueprint(self, blueprint, **options):
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
            return flask.Blueprint.register_blueprint(self, blueprint, **options)
        return super().register_blueprint(blueprint, **options)


def view_doc(view) -> dict:
    """Return what has been declared of a view: flask-smorest's entries and ours."""
    return getattr(view, "_apidoc", {})


def declare(view, key, value):
    """Add a declaration to a view, beside flask-smorest's, and return the view.

    No wrapper, so a declaration costs nothing per request. A copy, as flask-smorest makes: a
    wrapper shares its wrapped function's declarations until it declares something of its own.
    """
    view._apidoc = {**deepcopy(view_doc(view)), key: value}
    return view


def declare_errors(view, *kinds: errors.ErrorKind):
    return declare(view, "errors", [*view_doc(view).get("errors", []), *kinds])


def declare_parameter(view, parameter: dict):
    """Declare a request parameter the view reads itself (a header), beside its arguments."""
    arguments = deepcopy(view_doc(view).get("arguments", {}))
    arguments.setdefault("parameters", []).append(parameter)
    return declare(view, "arguments", arguments)


def declare_response(view, status: int, response: dict):
    """Declare (part of) an answer of the view: merged with what others declare for the status."""
    answers = deepcopy(view_doc(view).get("response", {}))
    answers.setdefault("responses", {}).setdefault(status, []).append(
        {"content_type": None, **response}
    )
    return declare(view, "response", answers)


def public(view):
    """Mark a view of the layer as open to requests without an API key."""
    return declare(view, "public", True)
