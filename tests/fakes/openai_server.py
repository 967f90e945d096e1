"""A loopback fake of an OpenAI-compatible chat-completions server, scripted request by request.

    with FakeOpenAI() as server:
        server.script(Status(429, headers={"Retry-After": "2"}), Reply(content='{"subquestions": ["a"]}'))
        ... OpenAIProvider(base_url=server.base_url) ...
        assert server.request_count == 2

Each request takes the next scripted behaviour, or `default` once the script is used up.
`max_in_flight` is the largest number of requests the server was handling at once.

For research tasks driven end to end, `Reply(content=research_reply)` answers each request as
its purpose asks (plan, extract, draft), and `hold(predicate)` keeps matching requests waiting
until the returned gate opens, so a test can stop a task between two phases:

    with FakeOpenAI(default=Reply(content=research_reply, delay=1.0)) as server:
        gate = server.hold(lambda body: purpose_of(body) == "extract")
"""

from __future__ import annotations

import json
import re
import threading
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest

from tests.fakes import LoopbackServer, QuietHandler

DEFAULT_USAGE = {"prompt_tokens": 11, "completion_tokens": 7, "total_tokens": 18}


@dataclass(frozen=True)
class Reply:
    """A normal completion; `content` may be a function of the request body. `delay` answers after N seconds."""

    content: str | Callable[[dict[str, Any]], str] = "{}"
    usage: dict[str, int] = field(default_factory=lambda: dict(DEFAULT_USAGE))
    tool_calls: list[dict[str, Any]] | None = None
    delay: float = 0.0
    model: str = "fake-model"


@dataclass(frozen=True)
class Status:
    """An error status (429 with Retry-After, 500, 401...) with an optional body, after `delay` seconds."""

    status: int
    headers: dict[str, str] = field(default_factory=dict)
    body: str = '{"error": {"message": "scripted error"}}'
    delay: float = 0.0


@dataclass(frozen=True)
class RawBody:
    """A 200 whose body is sent as given (for malformed responses)."""

    body: str
    content_type: str = "application/json"


Behaviour = Reply | Status | RawBody


# --- answers for research tasks ---------------------------------------------------------

# The system prompts tasks/gateway/providers/openai.py sends, by the words they start with.
PURPOSES = {"You plan research": "plan", "You extract evidence": "extract", "You write a research report": "draft"}
SOURCE = re.compile(r'source_id: (?P<id>[^\n]+)\n<untrusted origin="[^"]*">\n(?P<text>.*?)\n</untrusted>', re.DOTALL)
PLAIN = re.compile(r"[A-Za-z0-9 ,;:'()\-.]+")


def purpose_of(body: dict[str, Any]) -> str:
    """plan, extract, draft, or chat: what a chat-completions request from the research gateway is for."""
    messages = body.get("messages") or [{}]
    system = str(messages[0].get("content", ""))
    return next((name for prefix, name in PURPOSES.items() if system.startswith(prefix)), "chat")


def prompt_of(body: dict[str, Any]) -> tuple[str, str]:
    """(purpose, last user message): tells apart the calls of different tasks and sub-questions."""
    messages = body.get("messages") or [{}]
    return purpose_of(body), str(messages[-1].get("content", ""))


def research_reply(body: dict[str, Any]) -> str:
    """A purpose-appropriate JSON reply: two sub-questions for a plan, quotes copied verbatim from the
    sources in the request for an extraction (so they pass the gateway's check), a cited draft."""
    purpose, user = prompt_of(body)
    if purpose == "plan":
        question = user.split("Question:\n", 1)[-1].split("\n\nConstraints:", 1)[0].strip()
        return json.dumps({"subquestions": [question, f"{question} in practice"]})
    if purpose == "extract":
        quotes = []
        for match in SOURCE.finditer(user):
            for quote in plain_sentences(match["text"])[:2]:
                quotes.append({"source_id": match["id"], "quote": quote, "score": 0.5})
        return json.dumps({"quotes": quotes})
    if purpose == "draft":
        return json.dumps({"markdown": "## Findings\n\nThe sources agree on the main points [1]."})
    return json.dumps({"content": "ok"})


def plain_sentences(text: str) -> list[str]:
    """Plain sentences of a source, safe to find again verbatim in the original text."""
    found = []
    for sentence in re.split(r"(?<=[.!?])\s+", text):
        sentence = " ".join(sentence.split())
        if 40 <= len(sentence) <= 300 and PLAIN.fullmatch(sentence):
            found.append(sentence)
    return found


# --- the server --------------------------------------------------------------------------


class _Handler(QuietHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:
        server: FakeOpenAI = self.owner
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length)
        if self.path.rstrip("/") != "/v1/chat/completions":
            self._send(404, {"error": {"message": f"no route {self.path}"}})
            return
        body = json.loads(raw or b"{}")
        behaviour = server.begin(body, dict(self.headers))
        try:
            server.wait_at_gates(body)
            server.wait(getattr(behaviour, "delay", 0.0))
            if server.stopping.is_set():
                return
            if isinstance(behaviour, Status):
                self._send(behaviour.status, behaviour.body, headers=behaviour.headers)
            elif isinstance(behaviour, RawBody):
                self._send(200, behaviour.body, content_type=behaviour.content_type)
            else:
                self._send(200, completion(behaviour, body))
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up (a timeout test): nothing to answer
        finally:
            server.end()

    def _send(self, status: int, payload: Any, *, headers: dict[str, str] | None = None,
              content_type: str = "application/json") -> None:
        data = payload.encode() if isinstance(payload, str) else json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)


def completion(reply: Reply, request: dict[str, Any]) -> dict[str, Any]:
    """A chat.completion object for a scripted reply."""
    content = reply.content(request) if callable(reply.content) else reply.content
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if reply.tool_calls is not None:
        message["tool_calls"] = reply.tool_calls
    return {
        "id": "chatcmpl-fake",
        "object": "chat.completion",
        "model": reply.model,
        "choices": [{"index": 0, "message": message, "finish_reason": "tool_calls" if reply.tool_calls else "stop"}],
        "usage": reply.usage,
    }


class FakeOpenAI(LoopbackServer):
    handler_class = _Handler

    def __init__(self, default: Behaviour | None = None) -> None:
        super().__init__()
        self.default: Behaviour = default or Reply()
        self._script: deque[Behaviour] = deque()
        self._lock = threading.Lock()
        self.requests: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.held = 0  # requests waiting at a closed gate now
        self._gates: list[tuple[Callable[[dict[str, Any]], bool], threading.Event]] = []

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    @property
    def request_count(self) -> int:
        with self._lock:
            return len(self.requests)

    def script(self, *behaviours: Behaviour) -> None:
        """Queue behaviours for the next requests, in order."""
        with self._lock:
            self._script.extend(behaviours)

    def begin(self, body: dict[str, Any], headers: dict[str, str]) -> Behaviour:
        """Record a request and hand out its behaviour."""
        with self._lock:
            self.requests.append(body)
            self.headers.append(headers)
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            return self._script.popleft() if self._script else self.default

    def hold(self, predicate: Callable[[dict[str, Any]], bool]) -> threading.Event:
        """Keep requests whose body matches waiting until the returned gate is set (or the server stops)."""
        gate = threading.Event()
        with self._lock:
            self._gates.append((predicate, gate))
        return gate

    def wait_at_gates(self, body: dict[str, Any]) -> None:
        with self._lock:
            closed = [gate for predicate, gate in self._gates if not gate.is_set() and predicate(body)]
            self.held += len(closed) > 0
        try:
            for gate in closed:
                while not gate.wait(0.05) and not self.stopping.is_set():
                    pass
        finally:
            with self._lock:
                self.held -= len(closed) > 0

    def end(self) -> None:
        with self._lock:
            self.in_flight -= 1


@pytest.fixture
def fake_openai() -> Iterator[FakeOpenAI]:
    with FakeOpenAI() as server:
        yield server


@contextmanager
def serving_as_the_model(settings: Any, *, default: Reply | Status, model: str = "fake-model") -> Iterator[FakeOpenAI]:
    """A fake server named as the model provider by the settings the chat agent and the gateway read."""
    from asgiref.sync import SyncToAsync
    from django.db import connections

    with FakeOpenAI(default=default) as server:
        settings.LONGHAUL_MODEL_PROVIDER = "openai"
        settings.LONGHAUL_MODEL_BASE_URL = server.base_url
        settings.LONGHAUL_MODEL = model
        settings.LONGHAUL_MODEL_API_KEY = ""
        yield server
    # The agent queried from asgiref's sync thread: close its connection, or the test database cannot be dropped.
    SyncToAsync.single_thread_executor.submit(connections.close_all).result()

