"""A loopback fake of an OpenAI-compatible chat-completions server, scripted request by request.

    with FakeOpenAI() as server:
        server.script(Status(429, headers={"Retry-After": "2"}), Reply(content='{"subquestions": ["a"]}'))
        ... OpenAIProvider(base_url=server.base_url) ...
        assert server.request_count == 2

Each request takes the next scripted behaviour, or `default` once the script is used up.
`max_in_flight` is the largest number of requests the server was handling at once.
"""

from __future__ import annotations

import json
import threading
from collections import deque
from collections.abc import Callable, Iterator
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


class _Handler(QuietHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:  # noqa: N802 - the name http.server dispatches to
        server: FakeOpenAI = self.owner
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length)
        if self.path.rstrip("/") != "/v1/chat/completions":
            self._send(404, {"error": {"message": f"no route {self.path}"}})
            return
        body = json.loads(raw or b"{}")
        behaviour = server.begin(body, dict(self.headers))
        try:
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
        "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
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

    def end(self) -> None:
        with self._lock:
            self.in_flight -= 1


@pytest.fixture
def fake_openai() -> Iterator[FakeOpenAI]:
    with FakeOpenAI() as server:
        yield server
