"""Loopback fakes of the outside world that fail some of the time, for the drill's faulty cluster.

FaultyModel is an OpenAI-compatible chat-completions server: it answers each purpose (plan,
extract, draft, chat) with output the gateway accepts, and, drawn by a seeded random number,
answers 500, 429 with a short Retry-After, or too late for the client's timeout instead.

FaultySite is a SearxNG-style search endpoint (/search) and the pages it finds (/doc/<slug>):
some requests get 503 (a transient tool failure) or an answer too late for the tool's timeout.

Only the processes started with `faulty_cluster_env()` use them; the other cluster keeps the
offline provider and the offline corpus, as most deployments would.
"""

from __future__ import annotations

import dataclasses
import json
import re
import threading
from collections import Counter
from random import Random
from typing import Any
from urllib.parse import parse_qs, urlsplit

from chat.agent import RESEARCH
from tasks.gateway.providers.offline import plan_subquestions
from tests.fakes import LoopbackServer, QuietHandler
from tests.fakes.openai_server import Behaviour, FakeOpenAI, Reply, Status

MODEL_TIMEOUT_S = 1.5  # the faulty cluster's LONGHAUL_MODEL_TIMEOUT_S
TOOL_TIMEOUT_S = 1.0  # its LONGHAUL_VISIT_TIMEOUT_S (search uses it too)
LATE_BY_S = 1.5  # a "slow" answer comes this much after the client gave up

_QUESTION = re.compile(r"Question:\n(?P<q>.*?)\n\nConstraints:", re.DOTALL)
_AT_MOST = re.compile(r"at most (\d+)")
_SOURCE = re.compile(r"source_id: (?P<id>[^\n]+)\n<untrusted origin=\"[^\"]*\">\n(?P<text>.*?)\n</untrusted>",
                     re.DOTALL)
_EVIDENCE = re.compile(r'origin="\[(\d+)\] for sub-question')
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
# Quotable: plain prose that framing leaves as it is (no tags, no role markers, no colons).
_QUOTABLE = re.compile(r"^[A-Za-z0-9 ,.;'()\-\n]{40,300}$")


def _quiet_errors(server: LoopbackServer) -> None:
    """A client that gave up (its timeout) resets the connection: expected here, not worth a traceback."""
    server._server.handle_error = lambda request, client_address: None  # type: ignore[union-attr]


class FaultyModel(FakeOpenAI):
    """A model server that answers correctly, except when the dice say 500, 429 or too late."""

    def __enter__(self) -> FaultyModel:
        super().__enter__()
        _quiet_errors(self)
        return self

    def __init__(self, rng: Random, *, error_rate: float = 0.1, rate_limit_rate: float = 0.1,
                 slow_rate: float = 0.05) -> None:
        super().__init__()
        self.rng = rng
        self.rates = (error_rate, rate_limit_rate, slow_rate)
        self.faults: Counter[str] = Counter()
        self.purposes: Counter[str] = Counter()

    def begin(self, body: dict[str, Any], headers: dict[str, str]) -> Behaviour:
        super().begin(body, headers)  # records the request; its scripted behaviour is not used
        purpose = purpose_of(body)
        with self._lock:
            roll = self.rng.random()
            self.purposes[purpose] += 1
        error, limited, slow = self.rates
        if roll < error:
            return self._fault("model_500", Status(500))
        if roll < error + limited:
            return self._fault("model_429", Status(429, headers={"Retry-After": "0.2"}))
        reply = answer(purpose, body)
        if roll < error + limited + slow:
            return self._fault("model_timeout", dataclasses.replace(reply, delay=MODEL_TIMEOUT_S + LATE_BY_S))
        return reply

    def _fault(self, name: str, behaviour: Behaviour) -> Behaviour:
        with self._lock:
            self.faults[name] += 1
        return behaviour


def purpose_of(body: dict[str, Any]) -> str:
    messages = body.get("messages") or [{}]
    system = str(messages[0].get("content", ""))
    for prefix, purpose in (("You plan research", "plan"), ("You extract evidence", "extract"),
                            ("You write a research report", "draft")):
        if system.startswith(prefix):
            return purpose
    return "chat"


def answer(purpose: str, body: dict[str, Any]) -> Reply:
    """A correct answer for the purpose, computed from the request as a model would."""
    messages = body["messages"]
    if purpose == "chat":
        return _chat(messages)
    system, user = str(messages[0]["content"]), str(messages[-1]["content"])
    limit = int(m.group(1)) if (m := _AT_MOST.search(system)) else 3
    if purpose == "plan":
        found = _QUESTION.search(user)
        question = found["q"] if found else user
        return Reply(content=json.dumps({"subquestions": plan_subquestions(question, limit)}))
    if purpose == "extract":
        quotes = []
        for source in _SOURCE.finditer(user):
            picked = [s for s in _SENTENCE_END.split(source["text"]) if _QUOTABLE.match(s.strip())][:2]
            quotes += [{"source_id": source["id"], "quote": s.strip(), "score": 0.5} for s in picked]
        return Reply(content=json.dumps({"quotes": quotes[:limit]}))
    cited = "".join(f"[{n}]" for n in sorted(set(_EVIDENCE.findall(user)))[:3])
    return Reply(content=json.dumps({"markdown": f"The sources answer the question {cited}."}))


def _chat(messages: list[dict[str, Any]]) -> Reply:
    """The agent's turn: start research when asked to; after a tool's answer, say so."""
    if any('origin="tool ' in str(m.get("content", "")) for m in messages):
        return Reply(content="It is running in the background; I'll tell you here when it ends.")
    last_user = next((str(m.get("content", "")) for m in reversed(messages) if m.get("role") == "user"), "")
    found = RESEARCH.match(last_user)
    if found is None:
        return Reply(content="I run long jobs in the background.")
    topic = found["topic"].strip().rstrip("?.! ")
    call = {"id": "call-1", "type": "function", "function": {
        "name": "start_background_task",
        "arguments": json.dumps({"name": f"Research: {topic[:60]}", "question": topic})}}
    return Reply(content="", tool_calls=[call])


# --- the search endpoint and its pages -----------------------------------------------

DOCUMENTS: dict[str, tuple[str, list[str]]] = {
    "asyncio-cancellation": ("How asyncio cancellation works", [
        "A task is cancelled by calling its cancel method, which arranges for a CancelledError to be thrown "
        "into the wrapped coroutine at its next await.",
        "The coroutine may catch the CancelledError to clean up, but it should then re-raise it so the task "
        "really ends as cancelled.",
        "Cancellation is cooperative, so code that never awaits cannot be interrupted by a cancel request.",
        "A task group cancels its remaining tasks when one of them fails, and waits for all of them to finish.",
        "Shielding an awaitable protects the inner operation from cancellation of the outer task.",
    ]),
    "asyncio-timeouts": ("Timeouts in asyncio", [
        "The timeout context manager cancels the enclosed block when the deadline passes and raises TimeoutError "
        "in its place.",
        "A timeout is implemented with cancellation, so the same cleanup rules apply to code inside it.",
        "The wait_for function runs an awaitable with a deadline and cancels it when the deadline passes.",
        "Choosing a timeout means weighing a slow answer against giving up on a request that would succeed.",
    ]),
    "python-generators": ("Generators in Python", [
        "A generator function returns an iterator that runs the function body lazily, one value at a time.",
        "Each yield expression suspends the generator and hands a value to the caller of next.",
        "Closing a generator throws GeneratorExit into it, so its finally blocks run.",
        "Generators keep memory use flat because they produce items only when they are asked for.",
    ]),
    "context-managers": ("Context managers", [
        "A context manager sets something up on entry and tears it down on exit, even when an exception is raised.",
        "The with statement calls the enter method first and the exit method last, whatever happens in between.",
        "Locks, files and database transactions are typical context managers in practice.",
        "The contextlib module turns a generator with a single yield into a context manager.",
    ]),
    "threads-processes": ("Threads and processes", [
        "Threads share the memory of their process, while processes each have their own memory.",
        "The global interpreter lock lets only one thread run Python bytecode at a time in one process.",
        "Processes suit work that needs the processor, and threads suit work that waits for input and output.",
        "A process that is killed loses everything it held in memory, which is why durable work is checkpointed.",
    ]),
}


def _words(text: str) -> set[str]:
    return {w for w in re.findall(r"[a-z]+", text.lower()) if len(w) > 3}


class _SiteHandler(QuietHandler):
    protocol_version = "HTTP/1.0"

    def do_GET(self) -> None:  # noqa: N802 - the name http.server dispatches to
        site: FaultySite = self.owner
        parts = urlsplit(self.path)
        query = {name: values[0] for name, values in parse_qs(parts.query).items()}
        try:
            fault = site.roll("search" if parts.path == "/search" else "visit")
            if fault == "503":
                self._answer(503, b"busy, try again", "text/plain")
                return
            if fault == "slow":
                site.wait(TOOL_TIMEOUT_S + LATE_BY_S)
                if site.stopping.is_set():
                    return
            if parts.path == "/search":
                self._search(site, query.get("q", ""))
            elif parts.path.startswith("/doc/") and parts.path[5:] in DOCUMENTS:
                title, paragraphs = DOCUMENTS[parts.path[5:]]
                body = "".join(f"<p>{p}</p>\n" for p in paragraphs)
                page = f"<!doctype html><html><head><title>{title}</title></head><body><h1>{title}</h1>\n{body}"
                self._answer(200, (page + "</body></html>").encode(), "text/html; charset=utf-8")
            else:
                self._answer(404, b"not found", "text/plain")
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up (its timeout): nothing to answer

    def _search(self, site: FaultySite, q: str) -> None:
        wanted = _words(q)
        ranked = sorted(DOCUMENTS, key=lambda slug: -len(wanted & _words(" ".join([DOCUMENTS[slug][0],
                                                                                    *DOCUMENTS[slug][1]]))))
        results = [{"url": f"{site.url}/doc/{slug}", "title": DOCUMENTS[slug][0],
                    "content": DOCUMENTS[slug][1][0]} for slug in ranked[:3]]
        self._answer(200, json.dumps({"query": q, "results": results}).encode(), "application/json")

    def _answer(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class FaultySite(LoopbackServer):
    handler_class = _SiteHandler

    def __enter__(self) -> FaultySite:
        super().__enter__()
        _quiet_errors(self)
        return self

    def __init__(self, rng: Random, *, transient_rate: float = 0.12, slow_rate: float = 0.06) -> None:
        super().__init__()
        self.rng = rng
        self.rates = (transient_rate, slow_rate)
        self.faults: Counter[str] = Counter()
        self.requests: Counter[str] = Counter()
        self._lock = threading.Lock()

    def roll(self, tool: str) -> str | None:
        """This request's fault, if any: "503" or "slow"."""
        transient, slow = self.rates
        with self._lock:
            self.requests[tool] += 1
            roll = self.rng.random()
            fault = "503" if roll < transient else "slow" if roll < transient + slow else None
            if fault:
                self.faults[f"{tool}_{fault}"] += 1
        return fault


def faulty_cluster_env(model: FaultyModel, site: FaultySite) -> dict[str, str]:
    """What makes a cluster use the fakes: the openai provider on FaultyModel, web search on FaultySite."""
    return {
        "LONGHAUL_MODEL_PROVIDER": "openai",
        "LONGHAUL_MODEL_BASE_URL": model.base_url,
        "LONGHAUL_MODEL": "drill-model",
        "LONGHAUL_MODEL_TIMEOUT_S": str(MODEL_TIMEOUT_S),
        "LONGHAUL_SEARCH_URL": f"{site.url}/search",
        "LONGHAUL_VISIT_TIMEOUT_S": str(TOOL_TIMEOUT_S),
    }
