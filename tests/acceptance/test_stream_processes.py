"""A real daphne streams a task that a real qcluster runs: through Redis, and on the embedded default."""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import redis
from django.db import transaction

from tasks import clock, events
from tasks.events import NewEvent
from tasks.models import Task
from tasks.statuses import TaskStatus
from tests.drill.stream import StreamClient, session_cookie
from tests.factories import make_task, submit_sleep
from tests.processes import daphne, qcluster

pytestmark = [pytest.mark.acceptance, pytest.mark.django_db(transaction=True)]
REDIS_URL = "redis://127.0.0.1:6379/0"
WAIT = 30  # seconds for the whole task to stream; never slept
IDLE_SPELL = 8  # seconds: longer than channels_redis's 5 s blocking read


@contextmanager
def worker(log_dir: Path, **env: str) -> Iterator[None]:
    """A one-worker qcluster, stopped as an operator stops one: SIGTERM to its guard process."""
    with qcluster(log_dir, workers=1, **env) as cluster:
        yield
        # qcluster()'s own stop signals the whole process group, and workers signalled beside
        # their guard hang until the SIGKILL 30 s later; the guard alone stops them in ~3 s.
        cluster.popen.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            cluster.popen.wait(WAIT)


def ws_url(base: str, task: Task, after: int = 0) -> str:
    return base.replace("http://", "ws://") + f"/ws/tasks/{task.public_id}/?after={after}"


def stream_while_a_worker_runs(base: str, task: Task, cookie: str, log_dir: Path,
                               **worker_env: str) -> list[dict[str, Any]]:
    """Connect, read what is there already, start a worker, and read until the end message,
    reconnecting with the last seq if the server closes, as static/js/task_stream.js does."""
    client = StreamClient(ws_url(base, task), cookie=cookie, origin=base)
    received = [client.next(WAIT)]  # "queued", before any worker exists
    with worker(log_dir, **worker_env):
        deadline = time.monotonic() + WAIT
        while received[-1].get("type") != "end":
            frame = client.next(deadline - time.monotonic())
            if "closed" in frame:
                last = max((m["seq"] for m in received if "seq" in m), default=0)
                client = StreamClient(ws_url(base, task, after=last), cookie=cookie, origin=base)
                continue
            received.append(frame)
    client.drop(abort=False)
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
        received = stream_while_a_worker_runs(base, task, session_cookie(alice)[0], log_dir, REDIS_URL=REDIS_URL)
    assert_streamed_exactly_once_in_order(received, task)


def test_it_streams_a_task_run_by_another_process_by_polling_on_the_embedded_default(acme, alice, log_dir):
    task = submit_sleep(acme, alice, steps=5, step_seconds=0.3)
    # No Redis anywhere: the worker's wake-ups stay in its own memory, so the poll carries it.
    with daphne(log_dir, REDIS_URL="", LONGHAUL_STREAM_POLL_S="0.2") as base:
        received = stream_while_a_worker_runs(base, task, session_cookie(alice)[0], log_dir, REDIS_URL="")
    assert_streamed_exactly_once_in_order(received, task)


def test_a_stream_through_redis_outlives_an_idle_spell(acme, alice, log_dir, redis_available):
    # An idle consumer blocks reading Redis; a client socket timeout no longer than that read
    # (redis-py 8's 5 s default against channels_redis's 5 s BZPOPMIN) kills every idle stream.
    # Waiting is the point here. The poll, not a wake-up, then proves the consumer still lives.
    task = make_task(acme, alice, status=TaskStatus.RUNNING)
    with daphne(log_dir, REDIS_URL=REDIS_URL, LONGHAUL_STREAM_SAFETY_POLL_S="1") as base:
        client = StreamClient(ws_url(base, task), cookie=session_cookie(alice)[0], origin=base)
        said = client.next_or_none(IDLE_SPELL)
        assert said is None, (f"an idle stream said {said}: with redis-py 8 the channel layer needs a socket "
                              f"timeout above channels_redis's 5 s blocking read (CHANNEL_LAYERS in settings)")
        with transaction.atomic():
            events.append(task, [NewEvent("step_done")], status=task.status, at=clock.now())
        assert client.next(WAIT)["seq"] == 1
        client.drop(abort=False)
