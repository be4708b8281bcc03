"""The request's and the answer's edges, below the API layer: the body as it arrives, the proxy in
front, shedding what waited too long for a worker, the request ID, the security headers and the
JSON encoder of every answer."""
