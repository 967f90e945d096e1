"""One error shape for the whole API: {"error": "...", "code": "..."} (plus "field" when one is at fault).

Raised from anywhere as an ApiError or a runtime error, rendered here.
"""

from __future__ import annotations

import logging
import math
import uuid
from typing import Any, TypeVar

from django.conf import settings
from django.core.exceptions import PermissionDenied, RequestDataTooBig
from django.db.models import Model, QuerySet
from django.http import Http404
from rest_framework import exceptions, status
from rest_framework.response import Response

from tasks.errors import Conflict, InvalidInput, InvalidTransition, QuotaExceeded, TamperedContent

log = logging.getLogger(__name__)


class ApiError(exceptions.APIException):
    def __init__(self, message: str, *, code: str, status_code: int = 400, field: str | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.error_code = code
        self.field = field


M = TypeVar("M", bound=Model)


def get_by_public_id(rows: QuerySet[M], raw: str, *, noun: str) -> M:
    """The row of `rows` with this public id. A malformed id answers the same 404 as a missing
    one, and so does a row the caller may not see: nothing to probe."""
    try:
        public_id = uuid.UUID(raw)
    except ValueError:
        raise ApiError(f"no such {noun}", code="not_found", status_code=404) from None
    row = rows.filter(public_id=public_id).first()
    if row is None:
        raise ApiError(f"no such {noun}", code="not_found", status_code=404)
    return row


def _body(message: str, code: str, field: str | None = None) -> dict[str, Any]:
    body = {"error": message, "code": code}
    if field:
        body["field"] = field
    return body


def _first_validation_error(detail: Any, prefix: str = "") -> tuple[str | None, str]:
    if isinstance(detail, dict):
        for key, value in detail.items():
            name = key if key != "non_field_errors" else ""
            path = f"{prefix}.{name}" if prefix and name else (name or prefix)
            return _first_validation_error(value, path)
    if isinstance(detail, list) and detail:
        return _first_validation_error(detail[0], prefix)
    return (prefix or None), str(detail)


def render_api_error(exc: Exception, context: dict[str, Any]) -> Response | None:
    if isinstance(exc, ApiError):
        return Response(_body(str(exc.detail), exc.error_code, exc.field), status=exc.status_code)
    if isinstance(exc, RequestDataTooBig):
        # Raised by Django when DRF reads request.body; unhandled it becomes Django's bare HTML 400.
        limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
        return Response(_body(f"the body is larger than the limit of {limit} bytes", "body_too_large"),
                        status=status.HTTP_413_REQUEST_ENTITY_TOO_LARGE)
    if isinstance(exc, InvalidInput):
        return Response(_body(str(exc), "invalid_input", exc.field), status=status.HTTP_400_BAD_REQUEST)
    if isinstance(exc, Conflict):
        return Response(_body(str(exc), exc.code), status=status.HTTP_409_CONFLICT)
    if isinstance(exc, InvalidTransition):
        return Response(_body(str(exc), "invalid_transition"), status=status.HTTP_409_CONFLICT)
    if isinstance(exc, QuotaExceeded):
        response = Response(_body(str(exc), "queue_full"), status=status.HTTP_429_TOO_MANY_REQUESTS)
        response["Retry-After"] = str(exc.retry_after)
        return response
    if isinstance(exc, TamperedContent):
        log.error("sealed content failed its check: %s", exc)  # the operator's to see; the caller gets no content
        return Response(_body(f"stored content failed its integrity check and is not shown ({exc})",
                              "content_tampered"), status=status.HTTP_500_INTERNAL_SERVER_ERROR)
    if isinstance(exc, exceptions.ValidationError):
        field, message = _first_validation_error(exc.detail)
        text = f"{field}: {message}" if field else message
        return Response(_body(text, "invalid_input", field), status=status.HTTP_400_BAD_REQUEST)
    if isinstance(exc, exceptions.ParseError):
        return Response(_body(f"the body is not valid JSON: {exc.detail}", "malformed_json"), status=400)
    if isinstance(exc, Http404 | exceptions.NotFound):
        return Response(_body("not found", "not_found"), status=status.HTTP_404_NOT_FOUND)
    if isinstance(exc, exceptions.NotAuthenticated | exceptions.AuthenticationFailed):
        response = Response(_body(str(exc.detail), "not_authenticated"), status=exc.status_code)
        if getattr(exc, "auth_header", None):
            response["WWW-Authenticate"] = exc.auth_header
        return response
    if isinstance(exc, PermissionDenied | exceptions.PermissionDenied):
        return Response(_body(str(getattr(exc, "detail", exc) or "permission denied"), "permission_denied"),
                        status=status.HTTP_403_FORBIDDEN)
    if isinstance(exc, exceptions.APIException):
        codes = exc.get_codes()
        code = codes if isinstance(codes, str) else "error"
        response = Response(_body(str(exc.detail), code), status=exc.status_code)
        if isinstance(exc, exceptions.Throttled) and exc.wait is not None:
            response["Retry-After"] = str(max(1, math.ceil(exc.wait)))  # whole seconds, never "now"
        return response
    return None
