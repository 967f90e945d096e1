"""visit against a loopback web site: text extraction, size and time limits, types, redirects, SSRF refusals.

Loopback is a private address, so these tests turn LONGHAUL_ALLOW_PRIVATE_FETCH on,
except where they prove that it is refused when off.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator
from datetime import datetime

import httpx2
import pytest

from tasks.errors import PermanentError, StepTimeout, TransientError
from tasks.gateway.retry import RetryBudget
from tasks.gateway.tools import ToolCall, run_tool
from tasks.gateway.transport import AiohttpTransport, gateway_client, tls_context
from tests.fakes import RecordingSleep
from tests.fakes.http_site import HttpSite


@pytest.fixture
def http_site() -> Iterator[HttpSite]:
    with HttpSite() as site:
        yield site


@pytest.fixture
def private_fetch(settings):
    settings.LONGHAUL_ALLOW_PRIVATE_FETCH = True
    settings.LONGHAUL_VISIT_MAX_BYTES = 2_000_000
    settings.LONGHAUL_VISIT_TIMEOUT_S = 5.0
    return settings


class RecordingTransport(httpx2.AsyncBaseTransport):
    """The gateway's transport, noting the host of every request it is asked to send."""

    def __init__(self) -> None:
        self.inner = AiohttpTransport(limit=100, ssl_context=tls_context())
        self.hosts: list[str] = []

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        self.hosts.append(request.url.host)
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self.inner.aclose()


async def visit(url: str, *, budget: RetryBudget | None = None, sleep: RecordingSleep | None = None,
                transport: httpx2.AsyncBaseTransport | None = None) -> dict:
    async with (gateway_client(100) if transport is None
                else httpx2.AsyncClient(follow_redirects=False, transport=transport)) as client:
        return await run_tool(ToolCall("visit", {"url": url}), client=client, budget=budget or RetryBudget(0),
                              sleep=sleep or RecordingSleep())


async def test_it_turns_a_page_into_readable_text(private_fetch, http_site):
    url = f"{http_site.url}/page"

    page = await visit(url)

    assert page["title"] == "Cancellation in depth"
    assert "A task is cancelled by calling cancel() on it." in page["text"]
    assert "The coroutine then sees a CancelledError at its next await." in page["text"]
    assert "First point\nSecond point" in page["text"]
    for hidden in ("SCRIPT-SECRET", "MORE-SCRIPT", "color: red", "NAV-LINK-TEXT", "HIDDEN-INSTRUCTION",
                   "COMMENT-TEXT"):
        assert hidden not in page["text"]
    assert page["url"] == page["final_url"] == url
    assert page["content_type"] == "text/html"
    assert page["truncated"] is False
    assert page["content_hash"] == hashlib.sha256(page["text"].encode()).hexdigest()
    assert datetime.fromisoformat(page["fetched_at"]).tzinfo is not None


async def test_it_reads_plain_text(private_fetch, http_site):
    page = await visit(f"{http_site.url}/plain")

    assert page["text"] == "Plain notes\nLine two of the notes.\n"
    assert page["title"] == "Plain notes"
    assert page["content_type"] == "text/plain"


async def test_it_cuts_an_oversize_body_at_the_limit(private_fetch, http_site):
    private_fetch.LONGHAUL_VISIT_MAX_BYTES = 50_000

    page = await visit(f"{http_site.url}/big?total=5000000")

    assert page["truncated"] is True
    assert 40_000 < len(page["text"].encode()) <= 50_000


async def test_a_body_just_under_the_limit_is_whole(private_fetch, http_site):
    private_fetch.LONGHAUL_VISIT_MAX_BYTES = 50_000

    page = await visit(f"{http_site.url}/big?total=20000")

    assert page["truncated"] is False
    assert len(page["text"].encode()) == 20_000


async def test_a_slow_server_is_timed_out_and_not_retried_in_place(private_fetch, http_site):
    private_fetch.LONGHAUL_VISIT_TIMEOUT_S = 0.3
    budget = RetryBudget(3)
    started = time.monotonic()

    with pytest.raises(StepTimeout, match=r"0\.3 s"):
        await visit(f"{http_site.url}/slow?seconds=10", budget=budget)

    assert time.monotonic() - started < 3
    assert http_site.paths == ["/slow"]
    assert budget.used == 0


async def test_a_non_text_type_is_refused(private_fetch, http_site):
    with pytest.raises(PermanentError, match="image/png"):
        await visit(f"{http_site.url}/image")


@pytest.mark.parametrize("url", ["ftp://example.org/file.txt", "file:///etc/passwd", "gopher://x/"])
async def test_other_schemes_are_refused_by_name(private_fetch, url):
    scheme = url.split(":", 1)[0]

    with pytest.raises(PermanentError, match=rf"'{scheme}' scheme"):
        await visit(url)


async def test_a_loopback_url_is_refused_when_private_fetch_is_off(settings, http_site):
    settings.LONGHAUL_ALLOW_PRIVATE_FETCH = False

    with pytest.raises(PermanentError, match="loopback"):
        await visit(f"{http_site.url}/page")

    assert http_site.paths == []  # refused before connecting


async def test_localhost_by_name_is_refused_when_private_fetch_is_off(settings, http_site):
    settings.LONGHAUL_ALLOW_PRIVATE_FETCH = False

    with pytest.raises(PermanentError, match="loopback"):
        await visit(f"http://localhost:{http_site.port}/page")

    assert http_site.paths == []


async def test_a_redirect_to_a_link_local_address_is_refused_without_connecting(private_fetch, http_site):
    transport = RecordingTransport()
    budget = RetryBudget(3)

    with pytest.raises(PermanentError, match="link-local"):
        await visit(f"{http_site.url}/redirect-private", budget=budget, transport=transport)

    assert transport.hosts == ["127.0.0.1"]  # 169.254.169.254 was never asked for
    assert budget.used == 0


async def test_a_redirect_on_the_same_site_is_followed(private_fetch, http_site):
    url = f"{http_site.url}/redirect?to=/page&status=301"

    page = await visit(url)

    assert page["url"] == url
    assert page["final_url"] == f"{http_site.url}/page"
    assert page["title"] == "Cancellation in depth"


async def test_redirects_are_followed_at_most_five_times(private_fetch, http_site):
    with pytest.raises(PermanentError, match="more than 5 redirects"):
        await visit(f"{http_site.url}/loop")

    assert http_site.paths == ["/loop"] * 6


async def test_a_transient_failure_is_retried_within_the_budget(private_fetch, http_site):
    budget, sleep = RetryBudget(2), RecordingSleep()

    page = await visit(f"{http_site.url}/flaky?fail=1", budget=budget, sleep=sleep)

    assert page["title"] == "Cancellation in depth"
    assert budget.used == 1 and len(sleep.delays) == 1
    assert http_site.paths == ["/flaky", "/flaky"]


async def test_a_persistent_server_error_is_transient_once_the_budget_is_spent(private_fetch, http_site):
    budget = RetryBudget(1)

    with pytest.raises(TransientError, match="HTTP 500"):
        await visit(f"{http_site.url}/status?code=500", budget=budget)

    assert http_site.paths == ["/status", "/status"]
    assert budget.used == 1


async def test_a_missing_page_is_permanent(private_fetch, http_site):
    budget = RetryBudget(3)

    with pytest.raises(PermanentError, match="HTTP 404"):
        await visit(f"{http_site.url}/status?code=404", budget=budget)

    assert budget.used == 0


async def test_an_unknown_tool_is_permanent():
    async with gateway_client(100) as client:
        with pytest.raises(PermanentError, match="unknown tool"):
            await run_tool(ToolCall("shell", {"cmd": "ls"}), client=client, budget=RetryBudget(1))


async def test_a_compressed_page_is_read_as_its_text(private_fetch, http_site):
    page = await visit(f"{http_site.url}/gzipped")

    assert page["text"] == "Notes sent compressed.\n" * 50


async def test_a_cookie_one_visit_was_given_is_never_sent_on_another(private_fetch, http_site):
    """A gateway job's client serves every tenant's calls: what a site set on one visit must not reach the next."""
    async with gateway_client(100) as client:
        for path in ("set-cookie", "sent-cookie"):
            page = await run_tool(ToolCall("visit", {"url": f"{http_site.url}/{path}"}), client=client,
                                  budget=RetryBudget(0), sleep=RecordingSleep())

    assert page["text"].strip() == "cookie: none"


async def test_a_page_with_a_long_header_is_read(private_fetch, http_site):
    """httpx2 read a header block of up to 100 KiB; the transport under it must not refuse what it took."""
    page = await visit(f"{http_site.url}/long-header")

    assert page["title"] == "Cancellation in depth"


async def test_a_visit_asks_the_site_to_close_its_connection(private_fetch, http_site):
    """A page is one request to a host the job may never visit again: kept open, its connection would sit idle
    beside the job's cap (the transport counts only the connections in use)."""
    page = await visit(f"{http_site.url}/sent-connection")

    assert page["text"].strip() == "connection: close"


async def test_a_body_that_does_not_decode_is_a_permanent_error_naming_it(private_fetch, http_site):
    with pytest.raises(PermanentError, match="visit: 127.0.0.1 sent a body its Content-Encoding does not decode"):
        await visit(f"{http_site.url}/bad-gzip")
