"""Secret redaction for log records (DESIGN §8, §11): keys, tokens and passwords never reach a log line.

RedactSecrets is a logging filter, wired on every handler in settings.LOGGING. It rewrites the
record's message (with its arguments merged in), its traceback and its stack text, replacing:
- the values of secret settings (names ending in KEY, TOKEN, SECRET or PASSWORD, such as SECRET_KEY,
  LONGHAUL_MODEL_API_KEY, LONGHAUL_METRICS_TOKEN);
- credentials by shape: `Bearer ...`, `Basic ...`, DRF `Token <hex>`, `sk-...` API keys,
  `Authorization: ...` and `api_key=...`/`password=...`-style pairs (libpq's conninfo among them),
  and user:password@ in URLs. The database password is redacted by these shapes, not by value: a
  development password such as "longhaul" is also an ordinary word in log lines.
It is a safety net, not a licence: code still must not log task input, observations or prompts at
INFO or above.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable

REDACTED = "[redacted]"
SECRET_SETTING = re.compile(r"(KEY|TOKEN|SECRET|PASSWORD)$")
# Shorter values are too likely to occur in ordinary text to be replaced wherever they appear.
MIN_SECRET_LENGTH = 8

_PATTERNS: list[tuple[re.Pattern[str], str]] = [
    # user:password@host in URLs (database, Redis, proxies).
    (re.compile(r"(\b[a-z][a-z0-9+.-]*://[^/\s:@]+:)[^@\s/]+(@)", re.I), rf"\1{REDACTED}\2"),
    # Header-style and key=value pairs; the key is kept so the line still says what was there.
    (re.compile(r"""(\b(?:authorization|proxy-authorization|x-api-key|api[_-]?key|access[_-]?token|"""
                r"""refresh[_-]?token|client[_-]?secret|password|passwd|secret)\b["']?\s*[:=]\s*["']?)"""
                r"""(?:(?:bearer|basic|token)\s+)?[^\s"',;&}]+""", re.I), rf"\1{REDACTED}"),
    (re.compile(r"\b(bearer|basic)\s+[A-Za-z0-9._~+/=-]{8,}", re.I), rf"\1 {REDACTED}"),
    (re.compile(r"\bToken\s+[0-9a-fA-F]{20,}"), f"Token {REDACTED}"),
    (re.compile(r"\bsk-[A-Za-z0-9_-]{8,}"), REDACTED),
]


def secret_values() -> list[str]:
    """The current values of secret settings, longest first (so no secret is half-replaced by a shorter one)."""
    from django.conf import settings

    if not settings.configured:
        return []
    values = {str(getattr(settings, name)) for name in _secret_setting_names(dir(settings))
              if isinstance(getattr(settings, name, None), str)}
    return sorted((v for v in values if len(v) >= MIN_SECRET_LENGTH), key=len, reverse=True)


def _secret_setting_names(names: Iterable[str]) -> list[str]:
    return [name for name in names if name.isupper() and SECRET_SETTING.search(name)]


def redact(text: str) -> str:
    """The text with every secret we know of, or can recognise by shape, replaced."""
    for value in secret_values():
        if value in text:
            text = text.replace(value, REDACTED)
    for pattern, replacement in _PATTERNS:
        text = pattern.sub(replacement, text)
    return text


class RedactSecrets(logging.Filter):
    """Rewrites each record in place with its secrets redacted; never drops a record."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a broken format string is logging's own error to report; leave the record
            return True
        record.msg, record.args = redact(message), None
        if record.exc_info and not record.exc_text:
            # Formatted here, once, so the traceback text can be redacted before any handler prints it.
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact(record.exc_text)
        if record.stack_info:
            record.stack_info = redact(record.stack_info)
        return True
