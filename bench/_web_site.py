"""A web search API and the pages it finds, on loopback: what a research task reaches in production.

    with WebSite() as site:
        search_url = site.url + "/search"   # SearxNG's JSON shape, every result a page of this site

The site stands for other machines, so it should take as little of this one as it can. It is one asyncio event
loop on a thread of its own: tests/fakes/http_site.py (a thread for each request, HTTP/1.0) answered 400 page
requests at once from a bare client in 430 to 630 ms at the median on this 2-core machine, and in bench/inflight.py
that pace, not the gateway's, was the pace of the tool calls and of the wait for a slot in their pools. A page is
served as one from a site of its own would be: on a new connection, closed after it (a research task's pages come
from many hosts); the search API keeps its connections open, as one API host does.
"""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Self
from urllib.parse import parse_qs, quote, urlsplit

from tests.fakes.http_site import PAGE

MAX_HEAD = 64 * 1024


class WebSite:
    """`with` starts it on a free port and stops it; `url` is its base. `requests` counts what it answered."""

    def __init__(self) -> None:
        self.requests = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="bench-web-site", daemon=True)
        self._server: asyncio.Server | None = None

    def __enter__(self) -> Self:
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._serve, "127.0.0.1", 0, backlog=4096, limit=MAX_HEAD), self._loop).result(10)
        return self

    def __exit__(self, *exc_info: object) -> None:
        assert self._server is not None

        async def close(server: asyncio.Server) -> None:
            server.close()
            for task in asyncio.all_tasks() - {asyncio.current_task()}:
                task.cancel()

        asyncio.run_coroutine_threadsafe(close(self._server), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    @property
    def url(self) -> str:
        assert self._server is not None, "the site is not started"
        return f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                target = head.split(b"\r\n", 1)[0].split(b" ")[1].decode("latin-1")
                parts = urlsplit(target)
                query = {name: values[0] for name, values in parse_qs(parts.query).items()}
                self.requests += 1
                if parts.path == "/search":
                    writer.write(_answer(200, self._results(query.get("q", "")), "application/json", close=False))
                elif parts.path == "/page":
                    writer.write(_answer(200, PAGE.encode(), "text/html; charset=utf-8", close=True))
                else:
                    writer.write(_answer(404, b"not found", "text/plain", close=True))
                await writer.drain()
                if parts.path != "/search":
                    return
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError, IndexError):
            return  # the client went away, or sent what is not a request: the connection ends
        finally:
            writer.close()

    def _results(self, words: str) -> bytes:
        results = [{"url": f"{self.url}/page?n={n}&q={quote(words)}", "title": f"Result {n} for {words}",
                    "content": f"Snippet {n} about {words}"} for n in range(8)]
        return json.dumps({"query": words, "results": results}).encode()


def _answer(status: int, body: bytes, content_type: str, *, close: bool) -> bytes:
    reason = {200: "OK", 404: "Not Found"}[status]
    connection = b"Connection: close\r\n" if close else b""
    return (f"HTTP/1.1 {status} {reason}\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
            .encode() + connection + b"\r\n" + body)
