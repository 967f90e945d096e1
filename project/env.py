"""Settings from the environment: tiny readers that fail loudly on a bad value."""

from __future__ import annotations

import math
import os
import re

from django.core.exceptions import ImproperlyConfigured

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def envstr(name: str, default: str = "") -> str:
    return os.environ.get(name, default)


def envbool(name: str, default: bool = False) -> bool:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ImproperlyConfigured(f"{name} must be a boolean (1/0, true/false), got {raw!r}")


def envint(name: str, default: int, *, minimum: int | None = None, maximum: int | None = None) -> int:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ImproperlyConfigured(f"{name} must be an integer, got {raw!r}") from None
    if minimum is not None and value < minimum:
        raise ImproperlyConfigured(f"{name} must be at least {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ImproperlyConfigured(f"{name} must be at most {maximum}, got {value}")
    return value


def envfloat(name: str, default: float, *, minimum: float | None = None, maximum: float | None = None) -> float:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ImproperlyConfigured(f"{name} must be a number, got {raw!r}") from None
    if not math.isfinite(value):
        raise ImproperlyConfigured(f"{name} must be a finite number, got {raw!r}")
    if minimum is not None and value < minimum:
        raise ImproperlyConfigured(f"{name} must be at least {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ImproperlyConfigured(f"{name} must be at most {maximum}, got {value}")
    return value


# A rate's period words, as DRF's throttles spell them, in seconds.
_RATE_PERIODS = {"s": 1, "sec": 1, "second": 1, "m": 60, "min": 60, "minute": 60,
                 "h": 3600, "hour": 3600, "d": 86400, "day": 86400}


def parse_rate(text: str) -> tuple[int, int] | None:
    """A rate such as "60/min" as (requests, seconds); "off" is None, no limit. ValueError for anything else."""
    value = text.strip().lower()
    if value == "off":
        return None
    match = re.fullmatch(r"(\d+)\s*/\s*([a-z]+)", value, re.ASCII)
    if match is None or int(match[1]) < 1 or match[2] not in _RATE_PERIODS:
        raise ValueError(f"{text!r} is not a count of at least 1, then /s, /min, /hour or /day")
    return int(match[1]), _RATE_PERIODS[match[2]]


def envrate(name: str, default: str) -> tuple[int, int] | None:
    raw = os.environ.get(name)
    try:
        return parse_rate(default if raw is None or raw.strip() == "" else raw)
    except ValueError as exc:
        raise ImproperlyConfigured(f"{name} must be a rate such as 60/min, or off: {exc}") from None


def envlist(name: str, default: list[str]) -> list[str]:
    raw = os.environ.get(name)
    if raw is None:
        return default
    return [item.strip() for item in raw.split(",") if item.strip()]


def database_from_url(name: str, url: str) -> dict:
    """A DATABASES entry from a postgres:// or sqlite:// URL."""
    import dj_database_url

    try:
        config = dj_database_url.parse(url)
    except Exception as exc:  # dj_database_url raises several types for a bad URL
        raise ImproperlyConfigured(f"{name} is not a database URL we understand: {exc}") from exc
    engine = config.get("ENGINE", "")
    if engine == "django.db.backends.sqlite3":
        config["OPTIONS"] = sqlite_options()
    elif engine == "django.db.backends.postgresql":
        pass
    else:
        raise ImproperlyConfigured(f"{name} must be a postgres:// or sqlite:// URL, got engine {engine!r}")
    return config


def sqlite_options() -> dict:
    # IMMEDIATE takes the write lock at BEGIN, so two writers queue on the busy
    # timeout instead of failing with "database is locked" half-way through.
    return {
        "transaction_mode": "IMMEDIATE",
        "timeout": 20,
        "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
    }
