"""How the admin shows times, durations, JSON and links to other admin pages."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any
from urllib.parse import urlencode

from django.template.defaultfilters import pluralize
from django.urls import NoReverseMatch, reverse
from django.utils import timezone
from django.utils.dateformat import format as format_date
from django.utils.html import format_html
from django.utils.safestring import SafeString


def format_duration(seconds: float) -> str:
    whole = int(seconds)
    if whole < 60:
        return f"{whole}s"
    minutes, secs = divmod(whole, 60)
    if minutes < 60:
        return f"{minutes}m {secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 48:
        return f"{hours}h {minutes:02d}m"
    days, hours = divmod(hours, 24)
    return f"{days}d {hours}h"


def format_time(value: datetime | None) -> str:
    return format_date(timezone.localtime(value), "Y-m-d H:i:s") if value else "-"


def short_json(value: Any, limit: int = 160) -> str:
    text = json.dumps(value, ensure_ascii=False, sort_keys=True, default=str)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def counted(n: int, noun: str) -> str:
    return f"{n} {noun}{pluralize(n)}"


def admin_url(name: str, *args: Any, query: dict[str, Any] | None = None) -> str:
    """An admin URL, or "" when that admin is not registered (chat's, say)."""
    try:
        url = reverse(f"admin:{name}", args=args)
    except NoReverseMatch:
        return ""
    return f"{url}?{urlencode(query)}" if query else url


def link(url: str, text: str) -> SafeString | str:
    return format_html('<a href="{}">{}</a>', url, text) if url else text
