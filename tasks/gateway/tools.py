"""Tools behind one interface (DESIGN §9): `search` and `visit`.

search {"query": str, "limit": int} -> {"results": [{"url", "title", "snippet", "relevance"?}]}
    the bundled offline corpus, or a SearxNG-compatible JSON endpoint when LONGHAUL_SEARCH_URL is set.
visit {"url": str} -> {"url", "final_url", "title", "text", "fetched_at", "content_hash", "truncated",
    "content_type", "origin_url"?, "corpus"?}: corpus:// documents (with their docs.python.org address and
    which corpus answered), or an http(s) page through fetch.py's limits.
"""

from __future__ import annotations

import asyncio
import hashlib
import sqlite3
from dataclasses import dataclass
from typing import Any

import httpx2
from django.core.exceptions import ImproperlyConfigured

from project.env import envstr
from tasks import clock
from tasks.errors import InternalError, PermanentError, StepTimeout, TransientError
from tasks.gateway import configured, corpus
from tasks.gateway.fetch import fetch_page, raise_for_status, visit_settings
from tasks.gateway.retry import RetryBudget, Sleep, with_retries

TOOLS = ("search", "visit")
# The shapes of the tools' arguments and results; recorded on research tasks and on each tool call.
TOOL_PROTOCOL = "longhaul-tools/1"
MAX_QUERY_CHARS = 500
MAX_SEARCH_RESULTS = 50
CORPUS_SCHEME = "corpus://"


@dataclass(frozen=True)
class ToolCall:
    name: str  # "search" | "visit"
    args: dict[str, Any]


def search_url() -> str:
    """The web search endpoint, or "" for the offline corpus."""
    url = str(configured("LONGHAUL_SEARCH_URL", lambda n: envstr(n, ""))).strip()
    if url and not url.startswith(("http://", "https://")):
        raise ImproperlyConfigured(f"LONGHAUL_SEARCH_URL must be an http(s) URL, got {url!r}")
    return url


async def run_tool(call: ToolCall, *, client: httpx2.AsyncClient, budget: RetryBudget,
                   sleep: Sleep = asyncio.sleep) -> dict[str, Any]:
    """Run one tool call; failures are raised already classified."""
    if call.name == "search":
        query, limit = _search_args(call.args)
        return {"results": await search(query, limit=limit, client=client, budget=budget, sleep=sleep)}
    if call.name == "visit":
        url = call.args.get("url")
        if not isinstance(url, str) or not url.strip():
            raise PermanentError("visit: url must be a non-empty string")
        return await visit(url.strip(), client=client, budget=budget, sleep=sleep)
    raise PermanentError(f"unknown tool {call.name!r}")


def _search_args(args: dict[str, Any]) -> tuple[str, int]:
    query = args.get("query")
    limit = args.get("limit", 10)
    if not isinstance(query, str) or not query.strip():
        raise PermanentError("search: query must be a non-empty string")
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_SEARCH_RESULTS:
        raise PermanentError(f"search: limit must be an integer from 1 to {MAX_SEARCH_RESULTS}")
    return " ".join(query.split())[:MAX_QUERY_CHARS], limit


async def search(query: str, *, limit: int, client: httpx2.AsyncClient, budget: RetryBudget,
                 sleep: Sleep = asyncio.sleep) -> list[dict[str, str]]:
    """Results for `query` from the configured provider."""
    endpoint = search_url()
    if not endpoint:
        try:
            return await asyncio.to_thread(corpus.search, query, limit=limit)
        except corpus.CorpusBuilding as exc:
            raise TransientError(f"search: {exc}; try again shortly") from exc
        except (sqlite3.Error, corpus.CorpusUnavailable) as exc:
            raise InternalError(f"search: the offline corpus failed: {exc}") from exc
    # A 429's Retry-After pauses the search pool (tasks/pools.py), not this call alone.
    return await with_retries(lambda: web_search(endpoint, query, limit=limit, client=client),
                              budget=budget, sleep=sleep, max_inline_wait=0)


async def web_search(endpoint: str, query: str, *, limit: int, client: httpx2.AsyncClient) -> list[dict[str, str]]:
    """One request to a SearxNG-compatible endpoint: GET ?q=...&format=json -> results[].url/title/content."""
    timeout = visit_settings().timeout_s
    try:
        async with asyncio.timeout(timeout):
            # Merged, not replaced: an endpoint URL may carry parameters of its own (categories, a key).
            url = httpx2.URL(endpoint).copy_merge_params({"q": query, "format": "json"})
            response = await client.get(url, timeout=timeout, follow_redirects=False)
    except (TimeoutError, httpx2.TimeoutException) as exc:
        raise StepTimeout(f"search did not answer within {timeout:g} s") from exc
    except httpx2.TransportError as exc:
        raise TransientError(f"search unreachable: {type(exc).__name__}") from exc
    except httpx2.DecodingError as exc:  # as a body that is not JSON, below
        raise TransientError("search sent a body its Content-Encoding does not decode") from exc
    raise_for_status(response, what="search")
    try:
        items = response.json().get("results")
    except (ValueError, AttributeError) as exc:
        raise TransientError("search sent a body that is not a JSON object") from exc
    results: list[dict[str, str]] = []
    for item in items if isinstance(items, list) else []:
        url = item.get("url") if isinstance(item, dict) else None
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            continue
        if any(result["url"] == url for result in results):
            continue
        title, snippet = item.get("title"), item.get("content")
        results.append({
            "url": url[:2000],
            "title": " ".join(title.split())[:300] if isinstance(title, str) else url[:300],
            "snippet": " ".join(snippet.split())[:1000] if isinstance(snippet, str) else "",
        })
        if len(results) >= limit:
            break
    return results


async def visit(url: str, *, client: httpx2.AsyncClient, budget: RetryBudget,
                sleep: Sleep = asyncio.sleep) -> dict[str, Any]:
    """The text of a page: a corpus:// document, or an http(s) page fetched within the limits."""
    if url.startswith(CORPUS_SCHEME):
        return await asyncio.to_thread(corpus_page, url)
    return await fetch_page(url, client=client, budget=budget, sleep=sleep)


def corpus_page(url: str) -> dict[str, Any]:
    """The visit result for a corpus document."""
    try:
        document = corpus.read(url)
        which = corpus.describe()
    except corpus.CorpusBuilding as exc:
        raise TransientError(f"visit: {exc}; try again shortly") from exc
    except (sqlite3.Error, corpus.CorpusUnavailable) as exc:
        raise InternalError(f"visit: the offline corpus failed: {exc}") from exc
    if document is None:
        raise PermanentError(f"visit: no corpus document at {url}")
    return {
        "url": url,
        "final_url": url,
        "title": document["title"],
        "text": document["text"],
        "fetched_at": clock.now().isoformat(),
        "content_hash": hashlib.sha256(document["text"].encode("utf-8")).hexdigest(),
        "truncated": False,
        "content_type": "text/plain",
        "origin_url": corpus.origin_url(url),
        "corpus": which["label"],
    }
