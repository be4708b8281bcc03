"""Where the contract's operations live: the path every one is served under. Below everything
that needs it: the API layer serves under it, and the settings check server URLs against it."""

BASE_PATH = "/v1"
