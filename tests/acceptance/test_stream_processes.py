"""A real daphne streams a task that a real qcluster runs: through Redis, and on the embedded default."""

from __future__ import annotations

import json
import queue
import threading
import time
from typing import Any

import pytest
import redis
from autobahn.twisted.websocket import WebSocketClientFactory, WebSocketClientProtocol, connectWS
from django.conf import settings
from django.test import Client
from twisted.internet import reactor
from twisted.internet.threads import blockingCallFromThread

from tasks.models import Task
from tasks.statuses import TaskStatus
from tests.factories import submit_sleep
from tests.processes import daphne, qcluster

pytestmark = [pytest.mark.acceptance, pytest.mark.django_db(transaction=True)]
REDIS_URL = "redis://127.0.0.1:6379/0"
WAIT = 30  # seconds for the whole task to stream; never slept


def running_reactor() -> None:
    """Run Twisted's reactor (daphne installed it at django.setup()) in a thread, once per process."""
    if reactor.running:
        return
    started = threading.Event()
    reactor.callWhenRunning(started.set)
    threading.Thread(target=reactor.run, kwargs={"installSignalHandlers": False}, daemon=True).start()
    assert started.wait(WAIT), "the Twisted reactor did not start"


class _Protocol(WebSocketClientProtocol):
    def onOpen(self) -> None:
        self.factory.client.protocol = self

    def onMessage(self, payload: bytes, is_binary: bool) -> None:
        self.factory.client.frames.put(json.loads(payload))

    def onClose(self, was_clean: bool, code: int | None, reason: str | None) -> None:
        self.factory.client.frames.put({"closed": code})


class StreamClient:
    """A blocking WebSocket client that queues frames. It is autobahn's, which daphne brings
    along (the `websockets` package is not installed); its asyncio flavour cannot be used in
    a process where Django has loaded daphne, which selects Twisted for autobahn."""

    def __init__(self, url: str, *, cookie: str, origin: str) -> None:
        running_reactor()
        self.frames: queue.Queue[dict[str, Any]] = queue.Queue()
        self.protocol: _Protocol | None = None
        factory = WebSocketClientFactory(url, origin=origin, headers={"Cookie": cookie})
        factory.protocol = _Protocol
        factory.client = self
        blockingCallFromThread(reactor, connectWS, factory)

    def next(self, timeout: float) -> dict[str, Any]:
        try:
            return self.frames.get(timeout=max(timeout, 0))
        except queue.Empty:
            raise AssertionError(f"no frame within {timeout:.1f}s") from None

    def close(self) -> None:
        if self.protocol is not None:
            reactor.callFromThread(self.protocol.sendClose, 1000)


def session_cookie(user) -> str:
    client = Client()
    client.force_login(user)
    return f"{settings.SESSION_COOKIE_NAME}={client.cookies[settings.SESSION_COOKIE_NAME].value}"


def stream_while_a_worker_runs(base: str, task: Task, cookie: str, start_worker) -> list[dict[str, Any]]:
    """Connect, read what is there already, start the worker, and read until the end message."""
    ws_url = base.replace("http://", "ws://") + f"/ws/tasks/{task.public_id}/?after=0"
    client = StreamClient(ws_url, cookie=cookie, origin=base)
    received = [client.next(WAIT)]  # "queued", before any worker exists
    with start_worker():
        deadline = time.monotonic() + WAIT
        while received[-1].get("type") != "end":
            received.append(client.next(deadline - time.monotonic()))
            assert "closed" not in received[-1], received
    client.close()
    return received


def assert_streamed_exactly_once_in_order(received: list[dict[str, Any]], task: Task) -> None:
    task.refresh_from_db()
    assert task.status == TaskStatus.SUCCEEDED
    assert [m["seq"] for m in received[:-1]] == list(range(1, task.last_event_seq + 1))
    assert [m["kind"] for m in received if m.get("kind") == "step_done"] == ["step_done"] * 5
    assert received[-1] == {"type": "end", "status": "succeeded", "result_version": task.result_version}


@pytest.fixture
def redis_available() -> None:
    try:
        redis.Redis.from_url(REDIS_URL, socket_connect_timeout=1).ping()
    except redis.RedisError as exc:
        pytest.skip(f"Redis does not answer at {REDIS_URL} ({exc}); bin/ensure-redis starts one")


def test_it_streams_a_task_run_by_another_process_through_redis(acme, alice, log_dir, redis_available):
    task = submit_sleep(acme, alice, steps=5, step_seconds=0.3)
    # The safety-net poll is longer than the test may take: only Redis wake-ups can deliver in time.
    with daphne(log_dir, REDIS_URL=REDIS_URL, LONGHAUL_STREAM_SAFETY_POLL_S="60") as base:
        received = stream_while_a_worker_runs(
            base, task, session_cookie(alice), lambda: qcluster(log_dir, workers=1, REDIS_URL=REDIS_URL))
    assert_streamed_exactly_once_in_order(received, task)


def test_it_streams_a_task_run_by_another_process_by_polling_on_the_embedded_default(acme, alice, log_dir):
    task = submit_sleep(acme, alice, steps=5, step_seconds=0.3)
    # No Redis anywhere: the worker's wake-ups stay in its own memory, so the poll carries it.
    with daphne(log_dir, REDIS_URL="", LONGHAUL_STREAM_POLL_S="0.2") as base:
        received = stream_while_a_worker_runs(
            base, task, session_cookie(alice), lambda: qcluster(log_dir, workers=1, REDIS_URL=""))
    assert_streamed_exactly_once_in_order(received, task)
