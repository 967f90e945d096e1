"""The visit tool's HTTP fetch: scheme, address, size, time and content-type limits (HTML to text: html_text.py).

Address policy (checked on every hop, before any connection; `address_refusal`):
- always refused, even with LONGHAUL_ALLOW_PRIVATE_FETCH=1: link-local addresses (the
  cloud metadata service lives at 169.254.169.254), multicast, unspecified, "this
  network" (0.0.0.0/8) and reserved addresses; nothing legitimate is served there;
- refused unless LONGHAUL_ALLOW_PRIVATE_FETCH=1: loopback, private ranges (10/8,
  172.16/12, 192.168/16, fc00::/7), shared address space and anything else not global.
The connection goes to the address that was checked (the URL is pinned to it, with the
Host header and TLS server name kept), so a second DNS answer cannot slip past the check.
"""

from __future__ import annotations

import asyncio
import hashlib
import ipaddress
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx2
from django.core.exceptions import ImproperlyConfigured

from project.env import envbool, envfloat, envint
from tasks import clock
from tasks.errors import PermanentError, RateLimited, StepTimeout, TransientError
from tasks.gateway import configured
from tasks.gateway.html_text import html_to_text
from tasks.gateway.retry import RetryBudget, Sleep, retry_after_seconds, with_retries

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
Resolver = Callable[[str, int], Awaitable[list[IPAddress]]]

TEXT_TYPES = frozenset({"text/html", "text/plain", "application/xhtml+xml"})
HTML_TYPES = frozenset({"text/html", "application/xhtml+xml"})
MAX_REDIRECTS = 5
USER_AGENT = "Longhaul-research/0.1"
_THIS_NETWORK = ipaddress.ip_network("0.0.0.0/8")
_SHARED_SPACE = ipaddress.ip_network("100.64.0.0/10")


@dataclass(frozen=True)
class VisitSettings:
    allow_private: bool
    max_bytes: int
    timeout_s: float


def visit_settings() -> VisitSettings:
    """The visit tool's limits; raises ImproperlyConfigured naming the variable on a bad value."""
    allow = configured("LONGHAUL_ALLOW_PRIVATE_FETCH", lambda n: envbool(n, False))
    max_bytes = configured("LONGHAUL_VISIT_MAX_BYTES", lambda n: envint(n, 2_000_000, minimum=1024))
    timeout = configured("LONGHAUL_VISIT_TIMEOUT_S", lambda n: envfloat(n, 15.0, minimum=0.001))
    if not isinstance(allow, bool):
        raise ImproperlyConfigured(f"LONGHAUL_ALLOW_PRIVATE_FETCH must be a boolean, got {allow!r}")
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1024:
        raise ImproperlyConfigured(f"LONGHAUL_VISIT_MAX_BYTES must be an integer of at least 1024, got {max_bytes!r}")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ImproperlyConfigured(f"LONGHAUL_VISIT_TIMEOUT_S must be a positive number, got {timeout!r}")
    return VisitSettings(allow_private=allow, max_bytes=max_bytes, timeout_s=float(timeout))


# --- Where visit may connect ------------------------------------------------------


def address_refusal(address: IPAddress, *, allow_private: bool) -> str | None:
    """Why visit must not connect to `address` (e.g. "link-local"), or None when it may."""
    if isinstance(address, ipaddress.IPv6Address):
        embedded = address.ipv4_mapped or address.sixtofour or (address.teredo[1] if address.teredo else None)
        if embedded is not None:
            return address_refusal(embedded, allow_private=allow_private)
    if address.is_link_local:
        return "link-local"
    if address.is_multicast:
        return "multicast"
    if address.is_unspecified or address in _THIS_NETWORK:
        return "unspecified"
    if address.is_loopback:  # before "reserved": ::1 lies in the reserved ::/8
        return None if allow_private else "loopback"
    if address.is_reserved:
        return "reserved"
    if allow_private:
        return None
    if address.is_private or address in _SHARED_SPACE or not address.is_global:
        return "private"
    return None


async def resolve_host(host: str, port: int) -> list[IPAddress]:
    """The addresses a host name resolves to."""
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        if exc.errno in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)):
            raise PermanentError(f"visit: host {host} does not exist") from exc
        raise TransientError(f"visit: could not resolve {host}") from exc
    addresses: list[IPAddress] = []
    for *_, sockaddr in infos:
        address = ipaddress.ip_address(str(sockaddr[0]).split("%", 1)[0])
        if address not in addresses:
            addresses.append(address)
    if not addresses:
        raise PermanentError(f"visit: host {host} has no address")
    return addresses


async def checked_address(url: httpx2.URL, *, allow_private: bool, resolver: Resolver) -> IPAddress:
    """The address to connect to for `url`, after its scheme and every address it resolves to pass the policy."""
    if url.scheme not in ("http", "https"):
        raise PermanentError(f"visit refuses the {url.scheme or 'missing'!r} scheme: only http and https")
    if not url.host:
        raise PermanentError("visit: the URL has no host")
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        addresses: list[IPAddress] = [ipaddress.ip_address(url.host.strip("[]"))]
    except ValueError:
        addresses = await resolver(url.host, port)
    for address in addresses:
        reason = address_refusal(address, allow_private=allow_private)
        if reason:
            # One bad answer refuses the host: picking the good one would let DNS choose for us.
            raise PermanentError(f"visit refuses {url.host}: it resolves to a {reason} address")
    return addresses[0]


# --- One hop --------------------------------------------------------------------


@dataclass(frozen=True)
class Redirect:
    location: str


@dataclass(frozen=True)
class Body:
    content: bytes
    content_type: str
    charset: str | None
    truncated: bool


def _media_type(header: str) -> tuple[str, str | None]:
    media, _, params = header.partition(";")
    charset = None
    for param in params.split(";"):
        name, _, value = param.partition("=")
        if name.strip().lower() == "charset" and value.strip():
            charset = value.strip().strip('"').lower()
    return media.strip().lower(), charset


def raise_for_status(response: httpx2.Response, *, what: str) -> None:
    """Classify an error status where it is met: 429 rate-limited, 5xx transient, other 4xx permanent."""
    status = response.status_code
    if status == 429:
        raise RateLimited(f"{what} rate-limited the request (HTTP 429)",
                          retry_after=retry_after_seconds(response.headers.get("retry-after")))
    if status >= 500 or status == 408:
        raise TransientError(f"{what} failed with HTTP {status}")
    if status >= 400:
        raise PermanentError(f"{what} answered HTTP {status}")


async def fetch_once(url: httpx2.URL, *, client: httpx2.AsyncClient, config: VisitSettings,
                     resolver: Resolver) -> Redirect | Body:
    """One request to `url`: its redirect, or its body cut at the size limit."""
    address = await checked_address(url, allow_private=config.allow_private, resolver=resolver)
    host_header = url.netloc.decode("ascii")
    pinned = url.copy_with(host=str(address))
    extensions = {"sni_hostname": url.host} if url.scheme == "https" else {}
    request = client.build_request(
        "GET", pinned, timeout=config.timeout_s, extensions=extensions,
        # A page is one request to a host this job may not see again: its connection is not kept open.
        headers={"Host": host_header, "User-Agent": USER_AGENT, "Connection": "close",
                 "Accept": "text/html, application/xhtml+xml, text/plain;q=0.9"},
    )
    try:
        async with asyncio.timeout(config.timeout_s):
            response = await client.send(request, stream=True, follow_redirects=False)
            try:
                return await _read(response, url=url, config=config)
            finally:
                await response.aclose()
    except (TimeoutError, httpx2.TimeoutException) as exc:
        raise StepTimeout(f"visit: {url.host} did not answer within {config.timeout_s:g} s") from exc
    except httpx2.TransportError as exc:
        raise TransientError(f"visit: could not fetch from {url.host}: {type(exc).__name__}") from exc
    except httpx2.DecodingError as exc:  # not a TransportError: the body arrived, and is not what it says
        raise PermanentError(f"visit: {url.host} sent a body its Content-Encoding does not decode") from exc


async def _read(response: httpx2.Response, *, url: httpx2.URL, config: VisitSettings) -> Redirect | Body:
    if response.status_code in (301, 302, 303, 307, 308):
        location = response.headers.get("location")
        if not location:
            raise PermanentError(f"visit: {url.host} redirected without a Location")
        return Redirect(location)
    raise_for_status(response, what=f"visit: {url.host}")
    media, charset = _media_type(response.headers.get("content-type", ""))
    if media not in TEXT_TYPES:
        raise PermanentError(f"visit refuses content type {media or 'unknown'!r}: only HTML and plain text")
    content = bytearray()
    truncated = False
    async for chunk in response.aiter_bytes():
        room = config.max_bytes - len(content)
        if len(chunk) > room:
            content += chunk[:room]
            truncated = True
            break
        content += chunk
    return Body(bytes(content), media, charset, truncated)


# --- HTML to text ---------------------------------------------------------------


def decode_text(content: bytes, charset: str | None) -> str:
    """Plain text in its declared charset, UTF-8 otherwise; a cut multi-byte character is dropped."""
    try:
        return content.decode(charset or "utf-8", errors="replace")
    except LookupError:  # a charset Python does not know
        return content.decode("utf-8", errors="replace")


def page_result(url: str, final_url: str, body: Body) -> dict[str, Any]:
    """The visit result for a fetched body."""
    if body.content_type in HTML_TYPES:
        title, text = html_to_text(body.content, body.charset)
    else:
        text = decode_text(body.content, body.charset).replace("\r\n", "\n")
        title = next((line.strip() for line in text.splitlines() if line.strip()), "")[:200]
    return {
        "url": url,
        "final_url": final_url,
        "title": title or final_url,
        "text": text,
        "fetched_at": clock.now().isoformat(),
        "content_hash": hashlib.sha256(text.encode("utf-8")).hexdigest(),
        "truncated": body.truncated,
        "content_type": body.content_type,
    }


async def fetch_page(url: str, *, client: httpx2.AsyncClient, budget: RetryBudget, sleep: Sleep = asyncio.sleep,
                     resolver: Resolver = resolve_host, config: VisitSettings | None = None) -> dict[str, Any]:
    """Fetch an http(s) page as text, following at most MAX_REDIRECTS redirects, each hop checked."""
    config = config or visit_settings()
    try:
        current = httpx2.URL(url)
    except httpx2.InvalidURL as exc:
        raise PermanentError(f"visit: not a URL: {exc}") from exc
    for _ in range(MAX_REDIRECTS + 1):
        # A slow page is not retried in place: it would likely be slow again, and the runtime decides.
        outcome = await with_retries(
            lambda hop=current: fetch_once(hop, client=client, config=config, resolver=resolver),
            budget=budget, sleep=sleep, retry_on=(TransientError, RateLimited),
        )
        if isinstance(outcome, Redirect):
            try:
                current = current.join(outcome.location)
            except httpx2.InvalidURL as exc:
                raise PermanentError(f"visit: {current.host} redirected to an invalid URL") from exc
            continue
        return await asyncio.to_thread(page_result, url, str(current), outcome)
    raise PermanentError(f"visit: more than {MAX_REDIRECTS} redirects from {url}")
