"""A WebSocket watcher that keeps dropping its connection and resuming with ?after=<last seq>.

The client is autobahn's on Twisted: daphne is in INSTALLED_APPS, so django.setup() has
installed Twisted's reactor, and autobahn's asyncio flavour cannot run in this process (the
`websockets` package is not a dependency of the project). The reactor runs in a daemon thread.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from dataclasses import dataclass, field
from random import Random
from typing import Any

from autobahn.twisted.websocket import WebSocketClientFactory, WebSocketClientProtocol, connectWS
from django.conf import settings
from django.test import Client
from twisted.internet import reactor
from twisted.internet.threads import blockingCallFromThread

CONNECT_TIMEOUT = 10.0
_reactor_lock = threading.Lock()


def running_reactor() -> None:
    """Run Twisted's reactor in a daemon thread, once per process (watchers start it concurrently)."""
    with _reactor_lock:
        if reactor.running:
            return
        started = threading.Event()
        reactor.callWhenRunning(started.set)
        threading.Thread(target=reactor.run, kwargs={"installSignalHandlers": False}, daemon=True,
                         name="drill-reactor").start()
        assert started.wait(CONNECT_TIMEOUT), "the Twisted reactor did not start"


def session_cookie(user: Any) -> tuple[str, str]:
    """(Cookie header, session key) of a fresh session for `user`."""
    client = Client()
    client.force_login(user)
    key = client.cookies[settings.SESSION_COOKIE_NAME].value
    return f"{settings.SESSION_COOKIE_NAME}={key}", key


class _Protocol(WebSocketClientProtocol):
    def onOpen(self) -> None:  # noqa: N802 - autobahn's name
        self.factory.client.protocol = self

    def onMessage(self, payload: bytes, is_binary: bool) -> None:  # noqa: N802
        self.factory.client.frames.put(json.loads(payload))

    def onClose(self, was_clean: bool, code: int | None, reason: str | None) -> None:  # noqa: N802
        self.factory.client.frames.put({"closed": code})


class StreamClient:
    """One connection; frames arrive in a queue, a close arrives as {"closed": code}."""

    def __init__(self, url: str, *, cookie: str, origin: str) -> None:
        running_reactor()
        self.frames: queue.Queue[dict[str, Any]] = queue.Queue()
        self.protocol: _Protocol | None = None
        factory = WebSocketClientFactory(url, origin=origin, headers={"Cookie": cookie})
        factory.protocol = _Protocol
        factory.client = self
        blockingCallFromThread(reactor, connectWS, factory, timeout=CONNECT_TIMEOUT)

    def next(self, timeout: float) -> dict[str, Any]:
        frame = self.next_or_none(timeout)
        assert frame is not None, f"no frame within {timeout:.1f}s"
        return frame

    def next_or_none(self, timeout: float) -> dict[str, Any] | None:
        try:
            return self.frames.get(timeout=max(timeout, 0.0))
        except queue.Empty:
            return None

    def drop(self, *, abort: bool) -> None:
        """Close cleanly (1000), or cut the TCP connection as a lost network does."""
        protocol = self.protocol
        if protocol is None:
            return
        if abort:
            reactor.callFromThread(protocol.dropConnection, True)
        else:
            reactor.callFromThread(protocol.sendClose, 1000)


@dataclass
class StreamWatcher:
    """Follows one task's stream until its end message, reconnecting every `hold` seconds."""

    base: str
    task_public_id: str
    cookie: str
    rng: Random
    deadline: float  # time.monotonic() after which it gives up
    hold: tuple[float, float] = (0.4, 1.6)
    received: list[dict[str, Any]] = field(default_factory=list)
    end: dict[str, Any] | None = None
    connections: int = 0
    drops: int = 0
    server_closes: list[int | None] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None

    @property
    def cursor(self) -> int:
        """The highest seq seen: what a client resumes after (a repeated or late seq never moves it back)."""
        return max((frame["seq"] for frame in self.received), default=0)

    def url(self) -> str:
        return self.base.replace("http://", "ws://") + f"/ws/tasks/{self.task_public_id}/?after={self.cursor}"

    def start(self) -> None:
        self.thread = threading.Thread(target=self._run, name=f"drill-watch-{self.task_public_id[:8]}",
                                       daemon=True)
        self.thread.start()

    def join(self, timeout: float) -> None:
        if self.thread is not None:
            self.thread.join(timeout)

    def _run(self) -> None:
        while self.end is None and not self.stop.is_set() and time.monotonic() < self.deadline:
            try:
                client = StreamClient(self.url(), cookie=self.cookie, origin=self.base)
            except Exception as exc:  # daphne busy or restarting: try again shortly
                self.errors.append(f"connect: {type(exc).__name__}: {exc}")
                self.stop.wait(0.5)
                continue
            self.connections += 1
            until = min(time.monotonic() + self.rng.uniform(*self.hold), self.deadline)
            closed = False
            while self.end is None and not self.stop.is_set():
                frame = client.next_or_none(until - time.monotonic())
                if frame is None:
                    break
                if "closed" in frame:
                    self.server_closes.append(frame["closed"])
                    closed = True
                    break
                if frame.get("type") == "end":
                    self.end = frame
                else:
                    self.received.append(frame)
            if not closed:
                # Alternate a clean close with a cut connection; both must resume without loss.
                client.drop(abort=self.connections % 2 == 0)
                self.drops += 1
            self.stop.wait(0.1)
