"""Every request's two passes, app-wide: one before its view, one after its answer.

Each concern keeps its steps in its own module (logs, metrics, security headers, request IDs);
create_app lists them, in order, in one Flask hook each way rather than one hook per step: Flask
checks each hook for a coroutine and looks up its context on every request, and a step that
returns nothing costs only itself.
"""

from collections.abc import Callable, Iterable

from flask import Flask, Response


def register_hooks(
    app: Flask,
    before: Iterable[Callable[[], None]] = (),
    after: Iterable[Callable[[Response], None]] = (),
) -> None:
    """Run the `before` steps before every view, then the `after` steps on every answer."""

    def before_request() -> None:
        for step in before:
            step()

    def after_request(response: Response) -> Response:
        for step in after:
            step(response)
        return response

    app.before_request(before_request)
    app.after_request(after_request)
