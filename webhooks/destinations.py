"""Where webhooks may go: visit's rules (tasks/gateway/fetch.py), checked at registration and before every send.

http or https only; no link-local, multicast or reserved addresses ever; no loopback or private
addresses unless LONGHAUL_ALLOW_PRIVATE_FETCH=1. Every address the host resolves to must pass.
"""

from __future__ import annotations

import httpx2
from asgiref.sync import async_to_sync

from tasks.errors import InvalidInput, PermanentError
from tasks.gateway import fetch

MAX_URL_CHARS = 2000


async def checked(url: str) -> tuple[httpx2.URL, fetch.IPAddress]:
    """The parsed URL and the address to connect to; PermanentError when the policy refuses it."""
    try:
        parsed = httpx2.URL(url)
    except httpx2.InvalidURL as exc:
        raise PermanentError(f"not a URL: {exc}") from exc
    if parsed.userinfo:
        raise PermanentError("the URL must not carry a user name or password")
    allow_private = fetch.visit_settings().allow_private
    address = await fetch.checked_address(parsed, allow_private=allow_private, resolver=fetch.resolve_host)
    return parsed, address


def validate_url(url: str) -> str:
    """A URL fit to register, or InvalidInput naming the field `url`."""
    if len(url) > MAX_URL_CHARS:
        raise InvalidInput(f"url must be at most {MAX_URL_CHARS} characters", field="url")
    try:
        async_to_sync(checked)(url)
    except PermanentError as exc:
        raise InvalidInput(f"url refused ({reason(exc)})", field="url") from exc
    except Exception as exc:  # e.g. a transient DNS failure: refuse now rather than register blind
        raise InvalidInput(f"url could not be checked: {exc}", field="url") from exc
    return url


def reason(exc: Exception) -> str:
    """visit's refusal without its subject: the rule is the same, the subject here is a webhook."""
    text = str(exc)
    for prefix in ("visit refuses ", "visit: "):
        text = text.removeprefix(prefix)
    return text
