"""Animal Store: an HTTP/JSON service for managing the animals a store offers.

The app is made by create_app, in factory.py, which this package imports on first use rather
than with itself: `flask --app animal_store` imports the package before it looks for the app, and
takes any ImportError raised there for a missing app (it ends with "No such command 'db'", as if
Flask-Migrate were not installed). Raised when create_app is looked up, the release's own
ImportError is the last thing `flask` says, as it is where gunicorn imports wsgi.py.
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from animal_store.factory import MIGRATIONS_DIR, RESOURCES, create_app

__all__ = ["MIGRATIONS_DIR", "RESOURCES", "create_app"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from animal_store import factory

        return getattr(factory, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
