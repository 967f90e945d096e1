"""Gateways to the outside world: model providers (providers/) and tools (tools.py).

Settings they read, each from project settings when defined there, else from the
environment (a bad value raises ImproperlyConfigured naming the variable):

    LONGHAUL_MODEL_PROVIDER        offline | openai (default offline)
    LONGHAUL_MODEL_BASE_URL        OpenAI-compatible base URL, e.g. http://127.0.0.1:11434/v1
    LONGHAUL_MODEL_API_KEY         optional bearer token
    LONGHAUL_MODEL                 model name sent to the server
    LONGHAUL_MODEL_TIMEOUT_S       per request (default 60)
    LONGHAUL_OFFLINE_LATENCY_MS    artificial latency of the offline provider (default 0)
    LONGHAUL_SEARCH_URL            SearxNG-compatible JSON endpoint; unset = the offline corpus
    LONGHAUL_ALLOW_PRIVATE_FETCH   let visit reach private and loopback addresses (default off)
    LONGHAUL_VISIT_MAX_BYTES       body size limit of visit (default 2_000_000)
    LONGHAUL_VISIT_TIMEOUT_S       time limit of one visit request (default 15)
    LONGHAUL_CORPUS_PATH           the offline corpus index (default VAR_DIR/corpus.sqlite3)
    LONGHAUL_DOCS_PATH             the Python HTML documentation (default /usr/share/doc/python3.11/html)
    LONGHAUL_CORPUS_BUILD_WAIT_SECONDS  how long a search waits for the index being built (default 600)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from django.conf import settings

T = TypeVar("T")

_MISSING = object()


def configured(name: str, from_env: Callable[[str], T]) -> T:
    """A gateway setting: settings.NAME when the project defines it, else read from the environment."""
    value = getattr(settings, name, _MISSING)
    if value is _MISSING:
        return from_env(name)
    return value  # type: ignore[return-value]
