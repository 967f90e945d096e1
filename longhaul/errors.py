"""Typed errors of the Longhaul client: every one carries the API's `code` and, when one is at fault, `field`.

The server answers every error with one shape, `{"error": ..., "code": ..., "field"?: ...}`
(project/api_errors.py); `error_from_response` turns it into the subclass for its status, so
callers decide by type (or by `code`), never by message text.
"""

from __future__ import annotations

from typing import Any

import httpx2


class LonghaulError(Exception):
    """Base of every error this package raises."""

    code: str = "error"

    def __init__(self, message: str, *, code: str | None = None, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code or type(self).code
        self.field = field


class ApiError(LonghaulError):
    """The server answered with an error status."""

    def __init__(self, message: str, *, status: int, code: str | None = None, field: str | None = None,
                 retry_after: float | None = None) -> None:
        super().__init__(message, code=code or f"http_{status}", field=field)
        self.status = status
        self.retry_after = retry_after


class InvalidRequest(ApiError):
    """400 or 413: the request is wrong; `field` names the part at fault when there is one."""


class AuthenticationFailed(ApiError):
    """401: no token, or one the server does not know."""


class PermissionDenied(ApiError):
    """403: signed in, but not allowed (for example a user in no tenant)."""


class NotFound(ApiError):
    """404: no such task, or one the caller may not see (the server does not say which)."""


class Conflict(ApiError):
    """409: the task is not in a state that allows this (`not_ready`, `not_waiting`, `idempotency_key_reused`...)."""


class RateLimited(ApiError):
    """429: the queue is full; `retry_after` says how many seconds to wait."""


class ServerError(ApiError):
    """5xx: the server (or a proxy in front of it) failed."""


class ConnectionFailed(LonghaulError):
    """The server could not be reached, or stopped answering, after the retries."""

    code = "connection_failed"


class AmbiguousName(LonghaulError):
    """A task name matched several tasks; `candidates` lists them so the caller can pick an id."""

    code = "ambiguous_name"

    def __init__(self, name: str, candidates: list[dict[str, Any]]) -> None:
        listed = ", ".join(f"{task['id']} ({task['status']})" for task in candidates)
        super().__init__(f"{len(candidates)} tasks are named {name!r}: {listed}")
        self.name = name
        self.candidates = candidates


class NotSignedIn(LonghaulError):
    """No server URL or token: neither in the environment nor in the config file."""

    code = "not_signed_in"


_BY_STATUS: dict[int, type[ApiError]] = {
    400: InvalidRequest, 401: AuthenticationFailed, 403: PermissionDenied, 404: NotFound,
    409: Conflict, 413: InvalidRequest, 429: RateLimited,
}


def error_class(status: int) -> type[ApiError]:
    if status >= 500:
        return ServerError
    return _BY_STATUS.get(status, ApiError)


def _retry_after(response: httpx2.Response) -> float | None:
    raw = response.headers.get("Retry-After")
    try:
        return float(raw) if raw is not None else None
    except ValueError:
        return None  # an HTTP date: rare from this API, and a caller can still back off by itself


def error_from_response(response: httpx2.Response) -> ApiError:
    """The typed error for an error response: the API's own shape, or a plain one for a proxy's page."""
    try:
        body = response.json()
    except ValueError:
        body = None
    cls = error_class(response.status_code)
    if isinstance(body, dict) and isinstance(body.get("error"), str):
        code = body.get("code") if isinstance(body.get("code"), str) else None
        field = body.get("field") if isinstance(body.get("field"), str) else None
        message = body["error"]
    else:
        # Not the API speaking (a load balancer, a reverse proxy, a server that is not Longhaul).
        code, field = None, None
        message = f"HTTP {response.status_code} {response.reason_phrase}".strip()
    return cls(message, status=response.status_code, code=code, field=field, retry_after=_retry_after(response))
