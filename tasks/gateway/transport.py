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
from multidict import CIMultiDict
from yarl import URL

CHUNK_BYTES = 64 * 1024


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
    """Up to `limit` connections open at once, over all hosts; its session opens on the first request, on the
    event loop that sends it, and closes with the client."""

    def __init__(self, *, limit: int, ssl_context: ssl.SSLContext) -> None:
        self._limit, self._ssl_context = limit, ssl_context
        self._session: aiohttp.ClientSession | None = None

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self._limit, ssl=self._ssl_context),
                cookie_jar=aiohttp.DummyCookieJar(),  # the httpx2 client keeps the cookies
                auto_decompress=False,  # the httpx2 response decodes the body
                timeout=aiohttp.ClientTimeout(total=None),  # each request's own, from its httpx2 timeout
                trust_env=False,  # the httpx2 client sends proxied requests through a transport of its own
            )
        return self._session

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        timeout: dict[str, float | None] = request.extensions.get("timeout", {})
        sni = request.extensions.get("sni_hostname")
        body = await request.aread()
        try:
            response = await self._open().request(
                request.method, URL(str(request.url), encoded=True),
                headers=CIMultiDict((name.decode("latin-1"), value.decode("latin-1"))
                                    for name, value in request.headers.raw),
                data=body or None, allow_redirects=False,
                server_hostname=sni if sni and request.url.scheme == "https" else None,
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=timeout.get("connect"),
                                              sock_read=timeout.get("read")),
            )
        except Exception as exc:
            raise _as_httpx2(exc, connecting=True) from exc
        return httpx2.Response(
            status_code=response.status, headers=response.raw_headers, stream=_Body(response),
            extensions={"http_version": b"HTTP/1.1", "reason_phrase": (response.reason or "").encode("latin-1")})

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
            raise _as_httpx2(exc, connecting=False) from exc

    async def aclose(self) -> None:
        # Read to its end, the connection goes back to the pool; cut short (a visit's size limit), it is closed.
        if self._response.content.at_eof():
            self._response.release()
        else:
            self._response.close()


def _as_httpx2(exc: Exception, *, connecting: bool) -> Exception:
    """aiohttp's failure as the httpx2 exception its callers catch; anything else as it is."""
    message = str(exc) or type(exc).__name__
    kind: Any
    if isinstance(exc, aiohttp.ConnectionTimeoutError) or (connecting and isinstance(exc, TimeoutError)
                                                           and not isinstance(exc, aiohttp.SocketTimeoutError)):
        kind = httpx2.ConnectTimeout
    elif isinstance(exc, TimeoutError):
        kind = httpx2.ReadTimeout
    elif isinstance(exc, aiohttp.ClientConnectorError):
        kind = httpx2.ConnectError
    elif isinstance(exc, aiohttp.InvalidURL):
        kind = httpx2.UnsupportedProtocol
    elif isinstance(exc, aiohttp.ServerDisconnectedError | aiohttp.ClientResponseError):
        kind = httpx2.RemoteProtocolError
    elif isinstance(exc, aiohttp.ClientError | OSError):
        kind = httpx2.ReadError
    else:
        return exc
    return kind(message)
