"""The gateway's HTTP connections: httpx2's client on aiohttp's connection pool.

A gateway job keeps hundreds of calls out on one event loop, and that loop's CPU sets the pace of every call on it
(bench/inflight.py). httpx2's own transport (httpcore2 on anyio) spent 0.5 to 0.8 ms of CPU a request with 300 to
800 out at once, most of it its connection pool looking at every connection it holds for each request; aiohttp's
spent 0.17 ms (3,000 POSTs, 300 at once, against a loopback server in another process). The providers and tools
keep httpx2's client: its requests, URLs, responses, errors and content decoding, with redirects off. Only the
connections are aiohttp's, so a request goes where its URL says with the headers it carries (a pinned visit's Host),
its TLS to the name in its `sni_hostname` extension, and its failures are httpx2's exceptions.
"""

from __future__ import annotations

import functools
import ssl
from collections.abc import AsyncIterator
from http.cookiejar import CookieJar, DefaultCookiePolicy
from typing import Any

import aiohttp
import httpx2
from aiohttp.connector import NEEDS_CLEANUP_CLOSED
from aiohttp.http_exceptions import HttpProcessingError
from multidict import CIMultiDict
from yarl import URL

CHUNK_BYTES = 64 * 1024
MAX_HEADER_BYTES = 100 * 1024  # a response's status line or one header, at most (httpx2's whole header block)


def gateway_client(limit: int) -> httpx2.AsyncClient:
    """The client a gateway job's calls share (and a chat run's): up to `limit` connections, redirects not
    followed, and no cookies kept. It serves every tenant's calls, so a cookie a site set on one tenant's visit
    would go back to that site on another's."""
    return httpx2.AsyncClient(follow_redirects=False, cookies=CookieJar(DefaultCookiePolicy(allowed_domains=[])),
                              transport=AiohttpTransport(limit=limit, ssl_context=tls_context()))


@functools.cache
def tls_context() -> ssl.SSLContext:
    """The TLS settings of every gateway job in this process: building them reads the CA bundle (about 25 ms
    of CPU), once per process rather than once per job. An SSLContext serves any number of connections."""
    return httpx2.create_ssl_context()


class AiohttpTransport(httpx2.AsyncBaseTransport):
    """Up to `limit` connections in use at once, over all hosts (idle ones kept open for the next request to
    their host come besides: a visit asks its page's host to close, so they are the APIs', a few per host). Its
    session opens on the first request, on the event loop that sends it, and closes with the client."""

    def __init__(self, *, limit: int, ssl_context: ssl.SSLContext) -> None:
        self._limit, self._ssl_context = limit, ssl_context
        self._session: aiohttp.ClientSession | None = None

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(
                    limit=self._limit, ssl=self._ssl_context,
                    # This Python's asyncio can leave a TLS connection closed mid-body open (aiohttp's own check).
                    enable_cleanup_closed=NEEDS_CLEANUP_CLOSED),
                cookie_jar=aiohttp.DummyCookieJar(),  # the httpx2 client keeps the cookies
                auto_decompress=False,  # the httpx2 response decodes the body
                timeout=aiohttp.ClientTimeout(total=None),  # each request's own, from its httpx2 timeout
                trust_env=False,  # the httpx2 client sends proxied requests through a transport of its own
                skip_auto_headers=("Content-Type",),  # the httpx2 request has the headers it needs
                # httpx2 read a header block of up to 100 KiB; aiohttp's default refuses a header above 8 KiB.
                max_line_size=MAX_HEADER_BYTES, max_field_size=MAX_HEADER_BYTES,
            )
        return self._session

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        timeout: dict[str, float | None] = request.extensions.get("timeout", {})
        pool, connect = timeout.get("pool"), timeout.get("connect")
        sni = request.extensions.get("sni_hostname")
        body = await request.aread()  # sent whole, with its Content-Length: never chunked
        headers = CIMultiDict((name.decode("latin-1"), value.decode("latin-1")) for name, value in request.headers.raw
                              if name.lower() != b"transfer-encoding")
        if body:
            headers["Content-Length"] = str(len(body))
        try:
            response = await self._open().request(
                request.method, URL(str(request.url), encoded=True), headers=headers, data=body or None,
                allow_redirects=False, server_hostname=sni if sni and request.url.scheme == "https" else None,
                # httpx2's pool timeout bounds the wait for a connection (aiohttp's `connect` counts the pool's
                # wait and the connecting); it has no write timeout: the callers bound a whole exchange.
                timeout=aiohttp.ClientTimeout(total=None, connect=None if pool is None or connect is None
                                              else pool + connect, sock_connect=connect, sock_read=timeout.get("read")),
            )
        except Exception as exc:
            mapped = _as_httpx2(exc, connecting=True)
            if mapped is None:
                raise
            raise mapped from exc
        version = f"HTTP/{response.version.major}.{response.version.minor}" if response.version else "HTTP/1.1"
        return httpx2.Response(
            status_code=response.status, headers=response.raw_headers, stream=_Body(response),
            extensions={"http_version": version.encode(), "reason_phrase": (response.reason or "").encode("latin-1")})

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


class _Body(httpx2.AsyncByteStream):
    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self._response = response

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._response.content.iter_chunked(CHUNK_BYTES):
                yield chunk
        except Exception as exc:
            mapped = _as_httpx2(exc, connecting=False)
            if mapped is None:
                raise
            raise mapped from exc

    async def aclose(self) -> None:
        # Read to its end, the connection goes back to the pool; cut short (a visit's size limit), it is closed.
        if self._response.content.at_eof():
            self._response.release()
        else:
            self._response.close()


def _as_httpx2(exc: Exception, *, connecting: bool) -> Exception | None:
    """aiohttp's failure as the httpx2 exception its callers catch; None for anything else."""
    message = str(exc) or type(exc).__name__
    kind: Any
    if isinstance(exc, aiohttp.ConnectionTimeoutError) or (connecting and isinstance(exc, TimeoutError)
                                                           and not isinstance(exc, aiohttp.SocketTimeoutError)):
        kind = httpx2.ConnectTimeout
    elif isinstance(exc, TimeoutError):
        kind = httpx2.ReadTimeout
    elif isinstance(exc, aiohttp.ClientConnectorError):
        kind = httpx2.ConnectError
    elif isinstance(exc, aiohttp.InvalidURL | aiohttp.NonHttpUrlClientError):
        kind = httpx2.UnsupportedProtocol
    elif isinstance(exc, aiohttp.ServerDisconnectedError | aiohttp.ClientResponseError | HttpProcessingError):
        kind = httpx2.RemoteProtocolError
    elif isinstance(exc, aiohttp.ClientError | OSError):
        kind = httpx2.ReadError
    else:
        return None
    return kind(message)
