"""ws/threads/<id>/?after=N: status changes of a thread's tasks, for the owner only."""

from __future__ import annotations

import threading
import uuid

import pytest
from channels.db import database_sync_to_async
from channels.layers import get_channel_layer
from django.db import connection, transaction

from chat.models import Thread
from chat.streams import ThreadStream, thread_group
from tasks import clock, events
from tasks.events import NewEvent
from tasks.statuses import TaskStatus
from tasks.streams import CloseCode
from tests.factories import make_task
from tests.integration.test_stream import (  # noqa: F401  (fixtures)
    _close_consumer_connections, _stream_settings, alice_cookie, append_events, connected, frame, session_cookie,
    stream,
)

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def thread(acme, alice) -> Thread:
    return Thread.objects.create(tenant=acme, owner=alice, title="Research")


def thread_path(thread: Thread, after: int = 0) -> str:
    return f"/ws/threads/{thread.public_id}/?after={after}"


async def test_it_replays_the_status_changes_of_the_threads_tasks_in_cursor_order(acme, alice, alice_cookie, thread):
    first = await database_sync_to_async(make_task)(acme, alice, status=TaskStatus.RUNNING, thread=thread)
    second = await database_sync_to_async(make_task)(acme, alice, status=TaskStatus.RUNNING, thread=thread)
    elsewhere = await database_sync_to_async(make_task)(acme, alice, status=TaskStatus.RUNNING)
    for task in (first, second, elsewhere):
        await database_sync_to_async(append_events)(task, 1, kind="admitted")
        await database_sync_to_async(append_events)(task, 2)  # progress: not a status change
    await database_sync_to_async(append_events)(second, 1, kind="succeeded", status=TaskStatus.SUCCEEDED)
    comm = await connected(stream(thread_path(thread), alice_cookie))
    received = [await frame(comm) for _ in range(3)]
    assert await comm.receive_nothing(timeout=0.2), "progress and other threads' tasks stay out"
    await comm.disconnect()
    assert [m["seq"] for m in received] == [1, 2, 3], "numbered in the thread, whatever other threads hold"
    assert [(m["task"], m["task_seq"], m["kind"]) for m in received] == [
        (str(first.public_id), 1, "admitted"), (str(second.public_id), 1, "admitted"),
        (str(second.public_id), 4, "succeeded"),
    ]


async def test_it_follows_the_thread_on_a_wakeup(acme, alice, alice_cookie, thread):
    task = await database_sync_to_async(make_task)(acme, alice, status=TaskStatus.RUNNING, thread=thread)
    await database_sync_to_async(append_events)(task, 1, kind="admitted")
    comm = await connected(stream(thread_path(thread), alice_cookie))
    cursor = (await frame(comm))["seq"]
    comm2 = await connected(stream(thread_path(thread, after=cursor), alice_cookie))
    await database_sync_to_async(append_events)(task, 1, kind="paused", status=TaskStatus.PAUSED)
    group = thread_group(thread.pk)
    await get_channel_layer().group_send(group, {"type": "task.wakeup", "group": group})
    live, resumed = await frame(comm), await frame(comm2)
    await comm.disconnect()
    await comm2.disconnect()
    assert live == resumed
    assert live["kind"] == "paused" and live["seq"] > cursor and live["status"] == "paused"


@pytest.mark.skipif("connection.vendor != 'postgresql'", reason="SQLite runs one writer at a time: the second "
                    "status change waits for the first to commit")
def test_a_status_change_that_commits_after_a_later_one_is_still_streamed(acme, alice, thread):
    """Two tasks of the thread change status at once; the one that started first commits last. A reader
    that read in between must still get it after its cursor (by event id it would be skipped for good)."""
    first = make_task(acme, alice, status=TaskStatus.RUNNING, thread=thread)
    second = make_task(acme, alice, status=TaskStatus.RUNNING, thread=thread)
    stream = ThreadStream(thread.pk, thread.public_id)
    started, release = threading.Event(), threading.Event()

    def slow_commit() -> None:
        try:
            with transaction.atomic():
                events.append(first, [NewEvent("paused", {})], status=TaskStatus.PAUSED, at=clock.now())
                started.set()
                release.wait(10)
        finally:
            connection.close()

    writer = threading.Thread(target=slow_commit)
    writer.start()
    assert started.wait(10)
    append_events(second, 1, kind="succeeded", status=TaskStatus.SUCCEEDED)  # a higher event id, committed first
    seen = stream.read_after(0, 100).items
    assert [(m["seq"], m["kind"]) for m in seen] == [(1, "succeeded")]
    release.set()
    writer.join(10)
    later = stream.read_after(seen[-1]["seq"], 100).items
    assert [(m["seq"], m["task"], m["kind"]) for m in later] == [(2, str(first.public_id), "paused")]
    assert stream.read_after(0, 100).items == [*seen, *later], "numbers are kept, not given again"


@pytest.fixture(params=["bob", "charlie"])
def someone_elses_cookie(request) -> bytes:
    """A member of the same tenant who does not own the thread, and a member of another tenant."""
    return session_cookie(request.getfixturevalue(request.param))


async def test_it_closes_with_4404_for_someone_elses_thread(thread, someone_elses_cookie):
    comm = await connected(stream(thread_path(thread), someone_elses_cookie))
    assert await frame(comm) == {"closed": CloseCode.NOT_FOUND}
    await comm.disconnect()


async def test_it_closes_with_4404_for_a_deleted_or_missing_thread(thread, alice_cookie):
    await database_sync_to_async(Thread.objects.filter(pk=thread.pk).delete)()
    for path in (thread_path(thread), f"/ws/threads/{uuid.uuid4()}/?after=0"):
        comm = await connected(stream(path, alice_cookie))
        assert await frame(comm) == {"closed": CloseCode.NOT_FOUND}
        await comm.disconnect()


async def test_it_closes_with_4401_for_an_anonymous_client(thread):
    comm = await connected(stream(thread_path(thread)))
    assert await frame(comm) == {"closed": CloseCode.UNAUTHENTICATED}
    await comm.disconnect()
