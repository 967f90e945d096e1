"""search through a SearxNG-compatible JSON endpoint (LONGHAUL_SEARCH_URL), served on loopback."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tasks.errors import TransientError
from tasks.gateway.retry import RetryBudget
from tasks.gateway.tools import ToolCall, run_tool
from tasks.gateway.transport import gateway_client
from tests.fakes import RecordingSleep
from tests.fakes.http_site import HttpSite


@pytest.fixture
def http_site() -> Iterator[HttpSite]:
    with HttpSite() as site:
        yield site


async def search(query: str, limit: int, *, budget: RetryBudget, sleep: RecordingSleep | None = None) -> dict:
    async with gateway_client(100) as client:
        return await run_tool(ToolCall("search", {"query": query, "limit": limit}), client=client, budget=budget,
                              sleep=sleep or RecordingSleep())


async def test_it_queries_the_endpoint_and_keeps_clean_http_results(settings, http_site):
    settings.LONGHAUL_SEARCH_URL = f"{http_site.url}/search"

    results = (await search("asyncio   cancellation", 3, budget=RetryBudget(0)))["results"]

    assert http_site.queries == [{"q": "asyncio cancellation", "format": "json"}]
    assert results == [
        {"url": f"https://docs.example/{i}", "title": f"Result {i} for asyncio cancellation",
         "snippet": f"Snippet {i} about asyncio cancellation"}
        for i in range(3)
    ]


async def test_it_retries_a_busy_endpoint_within_the_budget(settings, http_site):
    settings.LONGHAUL_SEARCH_URL = f"{http_site.url}/search?fail=1"
    budget, sleep = RetryBudget(2), RecordingSleep()

    results = (await search("threads", 2, budget=budget, sleep=sleep))["results"]

    assert len(results) == 2
    assert budget.used == 1 and len(sleep.delays) == 1


async def test_a_busy_endpoint_is_transient_once_the_budget_is_spent(settings, http_site):
    settings.LONGHAUL_SEARCH_URL = f"{http_site.url}/search?fail=5"

    with pytest.raises(TransientError, match="503"):
        await search("threads", 2, budget=RetryBudget(1))

    assert http_site.paths == ["/search", "/search"]


async def test_a_body_that_does_not_decode_is_transient_and_says_so(settings, http_site):
    settings.LONGHAUL_SEARCH_URL = f"{http_site.url}/search?encoding=broken"

    with pytest.raises(TransientError, match="search sent a body its Content-Encoding does not decode"):
        await search("threads", 2, budget=RetryBudget(0))
