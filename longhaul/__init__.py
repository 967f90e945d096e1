"""Longhaul from outside the browser: a Python client (longhaul.client) and the `longhaul` command line."""

from __future__ import annotations

__version__ = "0.1.0"

# Re-exported lazily: `import longhaul` must stay cheap for the command line, and longhaul.calls
# imports __version__ from here while this module is still loading.
_EXPORTS = {
    "Client", "AsyncClient", "LonghaulError", "ApiError", "InvalidRequest", "AuthenticationFailed",
    "PermissionDenied", "NotFound", "Conflict", "RateLimited", "ServerError", "ConnectionFailed",
    "AmbiguousName", "NotSignedIn",
}


def __getattr__(name: str) -> object:
    if name in _EXPORTS:
        from longhaul import client

        return getattr(client, name)
    raise AttributeError(f"module 'longhaul' has no attribute {name!r}")


__all__ = [  # the names __getattr__ resolves
    "AmbiguousName", "ApiError", "AsyncClient", "AuthenticationFailed", "Client", "Conflict", "ConnectionFailed",
    "InvalidRequest", "LonghaulError", "NotFound", "NotSignedIn", "PermissionDenied", "RateLimited", "ServerError",
    "__version__",
]
