"""Every request's two passes, app-wide: one before its view, one after its answer.

Each concern keeps its steps in its own module (logs, metrics, security headers, request IDs);
create_app lists them, in order, in one Flask hook each way rather than one hook per step: Flask
checks each hook for a coroutine and looks up its context on every request, and a step that
returns nothing costs only itself.
"""

from collections.abc import Callable, Iterable
from typing import Any

from flask import Flask, Response


class AnimalStore(Flask):
    """Flask, which checks each view and hook for a coroutine once, not on every call.

    Flask's ensure_sync asks `inspect` whether a function is a coroutine function each time it
    calls a view, a hook or a teardown, eight times a list request: a few microseconds each
    request for an answer that never changes. The answer is kept by function (a bound method is
    equal to the next one made from the same object and function).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.synced: dict[Callable[..., Any], Callable[..., Any]] = {}

    def ensure_sync(self, func: Callable[..., Any]) -> Callable[..., Any]:
        try:
            return self.synced[func]
        except KeyError:
            synced = self.synced[func] = super().ensure_sync(func)
            return synced


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
