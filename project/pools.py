"""The gateway pools' limits, read from the environment at start (tasks/pools.py applies them).

Each kind of call has defaults (LONGHAUL_<KIND>_CONCURRENCY, LONGHAUL_<KIND>_REQUESTS_PER_MINUTE,
LONGHAUL_MODEL_TOKENS_PER_MINUTE; 0 means no rate limit), and LONGHAUL_POOLS overrides them for
one pool, as JSON keyed by the pool's name:

    LONGHAUL_POOLS='{"tool:search": {"concurrency": 4, "requests_per_minute": 60},
                     "model:openai:gpt-4o": {"tokens_per_minute": 200000}}'

A mistake fails the start with the pool and the field it is about, never a limit silently ignored.
"""

from __future__ import annotations

import json
from typing import Any

from django.core.exceptions import ImproperlyConfigured

KINDS = ("model", "tool", "mcp")
FIELDS = ("concurrency", "requests_per_minute", "tokens_per_minute")
MAX_LIMIT = 10_000_000


def parse(raw: str) -> dict[str, dict[str, int]]:
    """LONGHAUL_POOLS as {pool: {field: value}}; ImproperlyConfigured naming what is wrong."""
    if not raw.strip():
        return {}
    try:
        value: Any = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ImproperlyConfigured(f"LONGHAUL_POOLS must be a JSON object: {exc}") from None
    if not isinstance(value, dict):
        raise ImproperlyConfigured("LONGHAUL_POOLS must be a JSON object keyed by pool, such as \"tool:search\"")
    return {pool: _limits(pool, fields) for pool, fields in value.items()}


def _limits(pool: str, fields: Any) -> dict[str, int]:
    kind, _, name = pool.partition(":")
    if kind not in KINDS or not name:
        raise ImproperlyConfigured(
            f"LONGHAUL_POOLS: {pool!r} is not a pool; name one as model:<provider>:<model>, tool:<tool> or "
            "mcp:<server>")
    if not isinstance(fields, dict):
        raise ImproperlyConfigured(f"LONGHAUL_POOLS[{pool!r}] must be an object of limits")
    for field, limit in fields.items():
        if field not in FIELDS:
            raise ImproperlyConfigured(f"LONGHAUL_POOLS[{pool!r}]: unknown limit {field!r} (known: "
                                       f"{', '.join(FIELDS)})")
        if field == "tokens_per_minute" and kind != "model":
            raise ImproperlyConfigured(f"LONGHAUL_POOLS[{pool!r}]: tokens_per_minute applies to model pools only")
        if isinstance(limit, bool) or not isinstance(limit, int) or not 0 <= limit <= MAX_LIMIT:
            raise ImproperlyConfigured(f"LONGHAUL_POOLS[{pool!r}][{field!r}] must be a whole number from 0 to "
                                       f"{MAX_LIMIT}, got {limit!r}")
        if field == "concurrency" and limit < 1:
            raise ImproperlyConfigured(f"LONGHAUL_POOLS[{pool!r}]['concurrency'] must be at least 1")
    return dict(fields)
