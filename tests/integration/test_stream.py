"""ws/tasks/<id>/?after=N: replay, live follow, reconnects, tenant walls, end, back-pressure."""

from __future__ import annotations

import asyncio
import json
import threading
import uuid
from typing import Any

import pytest
from channels.db import database_sync_to_async
from channels.layers import get_channel_layer
from channels.testing import WebsocketCommunicator
from django.conf import settings as django_settings
from django.db import connection, connections, transaction
from django.test import Client

from project.asgi import application
from tasks import clock, events, jobs
from tasks.consumers import TaskStreamConsumer
from tasks.events import NewEvent
from tasks.models import Membership, Task
from tasks.read_threads import read_threads
from tasks.statuses import TaskStatus
from tasks.streams import CloseCode
from tests.conftest import make_user
from tests.factories import make_task, submit_sleep

pytestmark = pytest.mark.django_db(transaction=True)
ORIGIN = (b"origin", b"http://127.0.0.1")
WAIT = 5  # seconds a test waits for a frame before failing; never slept


@pytest.fixture(autouse=True)
def _stream_settings(settings):
    # A fresh in-memory layer per test, and a poll so slow that only wake-ups can deliver
    # in time: tests of the polling fallback lower it themselves.
    settings.CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}
    settings.LONGHAUL_STREAM_POLL_S = 60.0


@pytest.fixture(autouse=True)
async def _close_consumer_connections():
    """Consumers query from asgiref's sync thread and the read threads; close their connections so the test
    database can be dropped."""
    yield
    await database_sync_to_async(connections.close_all)()
    await asyncio.to_thread(read_threads().close_connections)


def session_cookie(user) -> bytes:
    client = Client()
    client.force_login(user)
    return f"{django_settings.SESSION_COOKIE_NAME}={client.cookies[django_settings.SESSION_COOKIE_NAME].value}".encode()


def stream(path: str, cookie: bytes | None = None, origin: tuple[bytes, bytes] = ORIGIN) -> WebsocketCommunicator:
    headers = [origin]
    if cookie is not None:
        headers.append((b"cookie", cookie))
    return WebsocketCommunicator(application, path, headers=headers)


def task_path(task: Task, after: int | str = 0) -> str:
    return f"/ws/tasks/{task.public_id}/?after={after}"


def append_events(task: Task, count: int, *, kind: str = "step_done", status: str | None = None) -> int:
    """Append `count` events in one transaction, as a step would; returns the last seq."""
    with transaction.atomic():
        if status is not None:
            Task.objects.filter(pk=task.pk).update(status=status)
        return events.append(task, [NewEvent(kind, {"n": n}) for n in range(count)],
                             status=status or task.status, at=clock.now())


async def frame(comm: WebsocketCommunicator) -> dict[str, Any]:
    """The next message, or {"closed": code} when the server closes."""
    output = await comm.receive_output(timeout=WAIT)
    if output["type"] == "websocket.close":
        return {"closed": output.get("code")}
    assert output["type"] == "websocket.send", output
    return json.loads(output["text"])


async def seqs_until(comm: WebsocketCommunicator, last: int) -> list[int]:
    """Seqs received until `last` arrives (end messages skipped)."""
    got: list[int] = []
    while not got or got[-1] < last:
        message = await frame(comm)
        assert "closed" not in message, f"closed after {got}: {message}"
        if "seq" in message:
            got.append(message["seq"])
    return got


async def connected(comm: WebsocketCommunicator) -> WebsocketCommunicator:
    accepted, _ = await comm.connect(timeout=WAIT)
    assert accepted
    return comm


@pytest.fixture
def alice_cookie(alice) -> bytes:
    return session_cookie(alice)


@pytest.fixture
def finished_task(acme, alice) -> Task:
    task = make_task(acme, alice, status=TaskStatus.RUNNING)
    append_events(task, 4)
    append_events(task, 1, kind="succeeded", status=TaskStatus.SUCCEEDED)
    Task.objects.filter(pk=task.pk).update(result_version=1)
    return task


# --- replay and end ----------------------------------------------------------------

async def test_it_replays_every_event_in_order_then_says_the_task_ended(finished_task, alice_cookie):
    comm = await connected(stream(task_path(finished_task), alice_cookie))
    received = [await frame(comm) for _ in range(6)]
    await comm.disconnect()
    assert [m.get("seq") for m in received[:5]] == [1, 2, 3, 4, 5]
    assert set(received[0]) == {"seq", "kind", "status", "at", "data"}
    assert received[4]["kind"] == "succeeded" and received[4]["status"] == "succeeded"
    assert received[5] == {"type": "end", "status": "succeeded", "result_version": 1}


async def test_it_replays_only_the_events_after_the_cursor(finished_task, alice_cookie):
    comm = await connected(stream(task_path(finished_task, after=3), alice_cookie))
    received = [await frame(comm) for _ in range(3)]
    await comm.disconnect()
    assert [m.get("seq") for m in received] == [4, 5, None]
    assert received[2]["type"] == "end"


async def test_it_says_end_at_once_to_a_client_that_has_seen_everything(finished_task, alice_cookie):
    comm = await connected(stream(task_path(finished_task, after=5), alice_cookie))
    assert await frame(comm) == {"type": "end", "status": "succeeded", "result_version": 1}
    # The socket stays open for late events; nothing more comes for now.
    assert await comm.receive_nothing(timeout=0.2)
    await comm.disconnect()


async def test_it_keeps_the_socket_open_after_the_end_for_late_events(finished_task, alice_cookie):
    comm = await connected(stream(task_path(finished_task), alice_cookie))
    assert (await seqs_until(comm, 5)) == [1, 2, 3, 4, 5]
    assert (await frame(comm))["type"] == "end"
    await database_sync_to_async(append_events)(finished_task, 1, kind="notified", status=TaskStatus.SUCCEEDED)
    late = await frame(comm)
    assert late["seq"] == 6 and late["kind"] == "notified"
    assert await comm.receive_nothing(timeout=0.2), "the same end is not repeated"
    await comm.disconnect()


# --- live --------------------------------------------------------------------------

async def test_it_follows_events_as_they_commit(acme, alice, alice_cookie):
    task = await database_sync_to_async(make_task)(acme, alice, status=TaskStatus.RUNNING)
    await database_sync_to_async(append_events)(task, 2)
    comm = await connected(stream(task_path(task), alice_cookie))
    assert await seqs_until(comm, 2) == [1, 2]
    await database_sync_to_async(append_events)(task, 3)
    assert await seqs_until(comm, 5) == [3, 4, 5]
    await database_sync_to_async(append_events)(task, 1, kind="succeeded", status=TaskStatus.SUCCEEDED)
    assert (await frame(comm))["seq"] == 6
    assert await frame(comm) == {"type": "end", "status": "succeeded", "result_version": 0}
    await comm.disconnect()


async def test_it_streams_a_task_the_runtime_runs_to_the_end(acme, alice, alice_cookie):
    task = await database_sync_to_async(submit_sleep)(acme, alice, steps=3)
    comm = await connected(stream(task_path(task), alice_cookie))
    for _ in range(10):  # one advance may run several steps in its time slice
        await database_sync_to_async(jobs.advance)(task.pk)
    await database_sync_to_async(task.refresh_from_db)()
    assert task.status == TaskStatus.SUCCEEDED
    messages = []
    while not messages or messages[-1].get("type") != "end":
        messages.append(await frame(comm))
    await comm.disconnect()
    assert [m["seq"] for m in messages[:-1]] == list(range(1, task.last_event_seq + 1))
    assert [m["kind"] for m in messages if m.get("kind") == "step_done"] == ["step_done"] * 3
    assert messages[-1] == {"type": "end", "status": "succeeded", "result_version": task.result_version}


async def test_a_lost_wakeup_only_delays_an_event_until_the_next_poll(acme, alice, alice_cookie, settings,
                                                                     monkeypatch):
    settings.LONGHAUL_STREAM_POLL_S = 0.1
    monkeypatch.setattr(events, "wake_subscribers", lambda *args, **kwargs: None)
    task = await database_sync_to_async(make_task)(acme, alice, status=TaskStatus.RUNNING)
    comm = await connected(stream(task_path(task), alice_cookie))
    await database_sync_to_async(append_events)(task, 3)
    assert await seqs_until(comm, 3) == [1, 2, 3]
    await comm.disconnect()


async def test_a_burst_of_wakeups_sends_each_event_once(acme, alice, alice_cookie):
    task = await database_sync_to_async(make_task)(acme, alice, status=TaskStatus.RUNNING)
    comm = await connected(stream(task_path(task), alice_cookie))
    await database_sync_to_async(append_events)(task, 5)
    layer = get_channel_layer()
    # Wake-ups that say nothing about seq cannot be filtered out: each must still cost no duplicate.
    group = events.task_group(task.public_id)
    await asyncio.gather(*(layer.group_send(group, {"type": "task.wakeup", "group": group}) for _ in range(20)))
    assert await seqs_until(comm, 5) == [1, 2, 3, 4, 5]
    await database_sync_to_async(append_events)(task, 1)
    assert await seqs_until(comm, 6) == [6]
    await comm.disconnect()


# --- reconnects --------------------------------------------------------------------

class Writer(threading.Thread):
    """Appends `total` events one transaction each, as another process would; pauses at
    `pause_at` until released, so a reconnect is certain to happen mid-stream."""

    def __init__(self, task: Task, *, total: int, pause_at: int, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(daemon=True)
        self.task, self.total, self.pause_at, self.loop = task, total, pause_at, loop
        self.release = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            for n in range(1, self.total + 1):
                if n == self.pause_at:
                    assert self.release.wait(WAIT * 2), "the client never reconnected"
                append_events(self.task, 1)
        except BaseException as exc:  # reported by the test, not lost in the thread
            self.error = exc
        finally:
            connection.close()

    def wake(self, public_id: object, seq: int, **_: object) -> None:
        """The wake-up another process would send through a cross-process layer."""
        layer = get_channel_layer()
        group = events.task_group(public_id)
        asyncio.run_coroutine_threadsafe(layer.group_send(group, events.wakeup(group, seq)), self.loop)


async def test_a_client_that_reconnects_with_its_last_seq_misses_nothing_and_gets_nothing_twice(
        acme, alice, alice_cookie, monkeypatch):
    total = 240
    task = await database_sync_to_async(make_task)(acme, alice, status=TaskStatus.RUNNING)
    writer = Writer(task, total=total, pause_at=160, loop=asyncio.get_running_loop())
    monkeypatch.setattr(events, "wake_subscribers", writer.wake)
    received: list[int] = []
    writer.start()
    for leave_after in (40, 100):  # leave twice while the writer is still writing
        comm = await connected(stream(task_path(task, after=received[-1] if received else 0), alice_cookie))
        received += await seqs_until(comm, leave_after)
        await comm.disconnect()
        assert writer.is_alive()
    comm = await connected(stream(task_path(task, after=received[-1]), alice_cookie))
    writer.release.set()
    received += await seqs_until(comm, total)
    await comm.disconnect()
    writer.join(WAIT)
    assert writer.error is None
    assert received == list(range(1, total + 1))


# --- who may watch -----------------------------------------------------------------

async def test_it_closes_with_4404_for_a_task_of_another_tenant(finished_task, charlie):
    cookie = await database_sync_to_async(session_cookie)(charlie)
    comm = await connected(stream(task_path(finished_task), cookie))
    assert await frame(comm) == {"closed": CloseCode.NOT_FOUND}
    await comm.disconnect()


async def test_it_closes_with_4404_for_another_members_task(finished_task, bob):
    cookie = await database_sync_to_async(session_cookie)(bob)
    comm = await connected(stream(task_path(finished_task), cookie))
    assert await frame(comm) == {"closed": CloseCode.NOT_FOUND}
    await comm.disconnect()


async def test_a_tenant_admin_may_watch_every_task_of_the_tenant(finished_task, acme):
    admin = await database_sync_to_async(make_user)("dora", acme, role=Membership.Role.ADMIN)
    cookie = await database_sync_to_async(session_cookie)(admin)
    comm = await connected(stream(task_path(finished_task), cookie))
    assert (await frame(comm))["seq"] == 1
    await comm.disconnect()


async def test_a_member_of_two_tenants_names_the_one_they_act_for(acme, globex, charlie):
    await database_sync_to_async(Membership.objects.create)(user=charlie, tenant=acme)
    task = await database_sync_to_async(make_task)(acme, charlie, status=TaskStatus.RUNNING)
    cookie = await database_sync_to_async(session_cookie)(charlie)
    comm = await connected(stream(task_path(task), cookie))
    assert await frame(comm) == {"closed": CloseCode.NOT_FOUND}, "globex, the oldest membership, is the default"
    await comm.disconnect()
    comm = await connected(stream(f"{task_path(task)}&tenant=acme", cookie))
    await database_sync_to_async(append_events)(task, 1)
    assert (await frame(comm))["seq"] == 1
    await comm.disconnect()


async def test_it_closes_with_4404_for_a_missing_task(alice_cookie):
    comm = await connected(stream(f"/ws/tasks/{uuid.uuid4()}/?after=0", alice_cookie))
    assert await frame(comm) == {"closed": CloseCode.NOT_FOUND}
    await comm.disconnect()


async def test_it_closes_with_4401_for_an_anonymous_client(finished_task):
    comm = await connected(stream(task_path(finished_task)))
    assert await frame(comm) == {"closed": CloseCode.UNAUTHENTICATED}
    await comm.disconnect()


async def test_it_closes_with_4400_for_a_cursor_that_is_not_a_number(finished_task, alice_cookie):
    comm = await connected(stream(task_path(finished_task, after="x"), alice_cookie))
    assert await frame(comm) == {"closed": CloseCode.BAD_REQUEST}
    await comm.disconnect()


async def test_it_refuses_a_connection_from_another_origin(finished_task, alice_cookie):
    comm = stream(task_path(finished_task), alice_cookie, origin=(b"origin", b"http://evil.example"))
    accepted, _ = await comm.connect(timeout=WAIT)
    assert not accepted


# --- back-pressure -----------------------------------------------------------------

async def test_a_client_too_far_behind_is_told_to_reconnect_and_loses_nothing(finished_task, alice_cookie,
                                                                                monkeypatch):
    # Batches of 2, at most 2 full ones in a row: 5 events cannot be sent in one go.
    monkeypatch.setattr(TaskStreamConsumer, "batch_size", 2)
    monkeypatch.setattr(TaskStreamConsumer, "max_batches_behind", 2)
    comm = await connected(stream(task_path(finished_task), alice_cookie))
    first = [await frame(comm) for _ in range(5)]
    await comm.disconnect()
    assert [m.get("seq", m.get("closed")) for m in first] == [1, 2, 3, 4, CloseCode.TOO_FAR_BEHIND]
    comm = await connected(stream(task_path(finished_task, after=4), alice_cookie))
    rest = [await frame(comm) for _ in range(2)]
    await comm.disconnect()
    assert rest[0]["seq"] == 5 and rest[1]["type"] == "end"
