"""JSON parsing that turns every malformed or abusive body into a 4xx in the API's error shape.

Limits, all from settings:
- DATA_UPLOAD_MAX_MEMORY_SIZE (LONGHAUL_MAX_BODY_BYTES, default 1 MB): a larger body is refused with 413.
  Django checks it when DRF reads request.body (project.api_errors renders that); the check here also
  covers a parser handed the raw stream, which Django does not limit.
- LONGHAUL_MAX_JSON_DEPTH (default 64): deeper nesting is refused with 400, well before Python's
  recursion limit, which serializing or hashing the value later would otherwise hit as a 500.
- NaN/Infinity, numbers too large for a double (1e999) and NUL characters (\\u0000) are refused with 400: neither can be stored in PostgreSQL jsonb.
"""

from __future__ import annotations

import json
import math
from typing import IO, Any

from django.conf import settings
from rest_framework.exceptions import ParseError
from rest_framework.parsers import JSONParser

from project.api_errors import ApiError


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _finite_float(text: str) -> float:
    """A JSON number as a float; one beyond a double's range (1e999) would read as infinity."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:40]} is too large")
    return value


def strict_loads(text: str) -> Any:
    """json.loads that refuses what PostgreSQL jsonb cannot store: NaN, Infinity and numbers beyond a
    double's range (ValueError, like any malformed JSON)."""
    return json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float)


def check_shape(value: Any, *, max_depth: int) -> None:
    """Refuse containers nested deeper than max_depth and strings holding NUL; iterative, so it cannot
    overflow the stack itself."""
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            if "\x00" in item:
                raise ApiError("the body contains a NUL character (\\u0000), which cannot be stored",
                               code="invalid_input")
            continue
        if isinstance(item, dict):
            children: list[Any] = [*item.keys(), *item.values()]
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth + 1 > max_depth:
            raise ApiError(f"the JSON body is nested more than {max_depth} levels deep", code="json_too_deep")
        stack.extend((child, depth + 1) for child in children)


class StrictJSONParser(JSONParser):
    def parse(self, stream: IO[bytes], media_type: str | None = None, parser_context: dict | None = None) -> Any:
        limit: int | None = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
        raw = stream.read() if limit is None else stream.read(limit + 1)
        if limit is not None and len(raw) > limit:
            raise ApiError(f"the body is larger than the limit of {limit} bytes", code="body_too_large",
                           status_code=413)
        encoding = (parser_context or {}).get("encoding") or settings.DEFAULT_CHARSET
        try:
            text = raw.decode(encoding)
        except (UnicodeDecodeError, LookupError):
            raise ParseError(f"the body is not valid {encoding} text") from None
        try:
            data = strict_loads(text)
        except RecursionError:
            raise ApiError(f"the JSON body is nested more than {settings.LONGHAUL_MAX_JSON_DEPTH} levels deep",
                           code="json_too_deep") from None
        except ValueError as exc:
            raise ParseError(f"JSON parse error - {exc}") from None
        check_shape(data, max_depth=settings.LONGHAUL_MAX_JSON_DEPTH)
        return data
