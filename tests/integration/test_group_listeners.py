"""A web process joins each wake-up group once, whatever number of its sockets follow the group, hands each
wake-up to every one of them, leaves the group with its last one, and joins its groups again when the layer
lost them (tasks/group_listeners.py)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid

import pytest
import redis
from channels.db import database_sync_to_async
from channels.layers import InMemoryChannelLayer, get_channel_layer
from channels_redis.core import RedisChannelLayer

from tasks import events, group_listeners
from tasks.group_listeners import GroupListeners
from tasks.statuses import TaskStatus
from tasks.streams import CloseCode
from tests.factories import make_task
from tests.integration.test_stream import (  # noqa: F401  (fixtures)
    WAIT,
    _close_consumer_connections,
    _stream_settings,
    alice_cookie,
    append_events,
    connected,
    frame,
    seqs_until,
    stream,
    task_path,
)

pytestmark = pytest.mark.django_db(transaction=True)
REDIS_URL = os.environ.get("LONGHAUL_TEST_REDIS_URL", "redis://127.0.0.1:6379/5")


async def test_sockets_following_one_task_in_one_process_make_one_member_of_its_group(acme, alice, alice_cookie):
    task = await database_sync_to_async(make_task)(acme, alice, status=TaskStatus.RUNNING)
    group = events.task_group(task.public_id)
    layer = get_channel_layer()
    first, second = [await connected(stream(task_path(task), alice_cookie)) for _ in range(2)]
    await database_sync_to_async(append_events)(task, 2)
    assert await seqs_until(first, 2) == [1, 2]
    assert await seqs_until(second, 2) == [1, 2]
    assert len(layer.groups[group]) == 1, "a commit is delivered to the process once, not once per socket"
    await first.disconnect()
    await database_sync_to_async(append_events)(task, 1)
    assert await seqs_until(second, 3) == [3], "the socket left keeps hearing the group"
    await second.disconnect()
    assert group not in layer.groups, "the process leaves the group with its last socket"


class RefusingLayer(InMemoryChannelLayer):
    """A layer that cannot add to a group, as Redis away."""

    async def group_add(self, group: str, channel: str) -> None:
        raise ConnectionError("the layer is away")


async def test_a_socket_that_cannot_listen_is_closed_and_frees_its_slot(acme, alice, alice_cookie, settings):
    settings.CHANNEL_LAYERS = {"default": {"BACKEND": f"{__name__}.RefusingLayer"}}
    settings.LONGHAUL_WS_MAX_PER_USER = 1
    task = await database_sync_to_async(make_task)(acme, alice, status=TaskStatus.RUNNING)
    for _ in range(2):  # a slot kept by the first would close the second with 4429
        comm = await connected(stream(task_path(task), alice_cookie))
        assert await frame(comm) == {"closed": CloseCode.INTERNAL_ERROR}
        await comm.disconnect()


def wakeup(group: str, seq: int = 1) -> dict:
    return events.wakeup(group, seq)


async def heard_by(heard: list, count: int) -> None:
    async with asyncio.timeout(WAIT):
        while len(heard) < count:
            await asyncio.sleep(0.01)


@pytest.fixture
async def in_memory():
    """Listeners on an in-memory layer of their own, stopped after the test."""
    listeners = GroupListeners(PausingLayer())
    yield listeners
    if stopped := listeners.stop():
        await asyncio.wait(stopped, timeout=WAIT)


class PausingLayer(InMemoryChannelLayer):
    """Joins and leaves take a while, as a round trip to Redis does; a group named in `held` waits for
    `release`; a group named in `refused` is refused."""

    def __init__(self) -> None:
        super().__init__()
        self.held: set[str] = set()
        self.refused: set[str] = set()
        self.release = asyncio.Event()
        self.asked: list[str] = []
        self.adds: list[str] = []

    async def group_add(self, group: str, channel: str) -> None:
        self.asked.append(group)
        await asyncio.sleep(0.01)
        if group in self.held:
            await self.release.wait()
        if group in self.refused:
            raise ConnectionError(f"{group} refused")
        self.adds.append(group)
        await super().group_add(group, channel)

    async def group_discard(self, group: str, channel: str) -> None:
        await asyncio.sleep(0.01)
        await super().group_discard(group, channel)


async def test_a_listener_that_fails_does_not_deafen_the_others(in_memory):
    heard: list = []

    def failing(message: dict) -> None:
        raise RuntimeError("a stream that broke")

    await in_memory.join("g", failing)
    await in_memory.join("g", heard.append)
    await in_memory.layer.group_send("g", wakeup("g", 1))
    await in_memory.layer.group_send("g", wakeup("g", 2))
    await heard_by(heard, 2)
    assert [message["seq"] for message in heard] == [1, 2]


async def test_a_group_left_by_its_last_listener_while_another_comes_ends_up_joined(in_memory):
    heard: list = []
    leaving: list = []
    await in_memory.join("g", leaving.append)
    await asyncio.gather(in_memory.leave("g", leaving.append), in_memory.join("g", heard.append))
    assert in_memory.groups() == ["g"] and len(in_memory.layer.groups["g"]) == 1
    await in_memory.layer.group_send("g", wakeup("g"))
    await heard_by(heard, 1)
    await in_memory.leave("g", heard.append)
    assert "g" not in in_memory.layer.groups and in_memory.groups() == []


async def test_listeners_that_come_together_join_their_group_once(in_memory):
    heard: list = []
    await asyncio.gather(*(in_memory.join("g", heard.append) for _ in range(5)))
    assert in_memory.layer.adds.count("g") == 1


async def test_a_group_slow_to_join_holds_back_no_other_group(in_memory):
    in_memory.layer.held.add("slow")
    slow = asyncio.ensure_future(in_memory.join("slow", print))
    async with asyncio.timeout(WAIT):
        while "slow" not in in_memory.layer.asked:
            await asyncio.sleep(0.01)
    heard: list = []
    async with asyncio.timeout(WAIT):  # behind one lock, it would wait for "slow"
        await in_memory.join("fast", heard.append)
    await in_memory.layer.group_send("fast", wakeup("fast"))
    await heard_by(heard, 1)
    assert not slow.done()
    in_memory.layer.release.set()
    await slow


async def test_a_group_the_layer_refuses_leaves_no_listener_behind(in_memory):
    in_memory.layer.refused.add("g")
    with pytest.raises(ConnectionError):
        await in_memory.join("g", print)
    assert in_memory.groups() == [] and "g" not in in_memory.layer.groups
    in_memory.layer.refused.clear()
    heard: list = []
    await in_memory.join("g", heard.append)
    await in_memory.layer.group_send("g", wakeup("g"))
    await heard_by(heard, 1)


async def test_it_hears_only_the_groups_it_joined(in_memory):
    heard: list = []
    await in_memory.join("g", heard.append)
    await in_memory.layer.group_add("other", in_memory._channel)  # a membership left behind by a failed leave
    await in_memory.layer.group_send("other", wakeup("other"))
    await in_memory.layer.group_send("g", wakeup("g"))
    await heard_by(heard, 1)
    assert [message["group"] for message in heard] == ["g"]


async def test_a_wakeup_that_names_no_group_is_reported_once(in_memory, caplog):
    heard: list = []
    await in_memory.join("g", heard.append)
    for _ in range(2):
        await in_memory.layer.group_send("g", {"type": "task.wakeup", "seq": 1})  # as an older process sends it
    await in_memory.layer.group_send("g", wakeup("g"))
    await heard_by(heard, 1)
    assert [record.message for record in caplog.records].count(
        "a wake-up that names no group (sent by a process older than this one) reached no stream; streams read at "
        "their safety poll until every process is updated") == 1


class StuckSends(PausingLayer):
    """A layer whose sends to a process's own group never end, even when cancelled."""

    def __init__(self) -> None:
        super().__init__()
        self.own_sends = 0
        self.ended = asyncio.Event()  # set at the test's end, so no task outlives its loop

    async def group_send(self, group: str, message: dict) -> None:
        if not group.startswith("listeners-"):
            return await super().group_send(group, message)
        self.own_sends += 1
        while not self.ended.is_set():
            with contextlib.suppress(asyncio.CancelledError):
                await self.ended.wait()


async def test_a_check_whose_send_never_ends_leaves_one_send_waiting_not_one_per_check(monkeypatch):
    monkeypatch.setattr(group_listeners, "CHECK_S", 0.01)
    monkeypatch.setattr(group_listeners, "ANSWER_S", 0.01)
    layer = StuckSends()
    listeners = GroupListeners(layer)
    await listeners.join("g", print)
    own = [group for group in layer.adds if group.startswith("listeners-")]
    try:
        async with asyncio.timeout(WAIT):
            while layer.adds.count(own[0]) < 4:  # the first join, then three checks that got no answer
                await asyncio.sleep(0.01)
        assert layer.own_sends == 1
    finally:
        layer.ended.set()
        await asyncio.wait(listeners.stop(), timeout=WAIT)


# --- on Redis: memberships the layer lost ---------------------------------------------

@pytest.fixture
async def on_redis(monkeypatch):
    """Listeners on a Redis layer with a key prefix and a client name of their own, so the test can drop its
    keys and connections and no others (tests run side by side); stopped after the test."""
    try:
        redis.Redis.from_url(REDIS_URL, socket_connect_timeout=1).ping()
    except redis.RedisError as exc:
        pytest.skip(f"Redis does not answer at {REDIS_URL} ({exc})")
    monkeypatch.setattr(group_listeners, "CHECK_S", 0.05)
    monkeypatch.setattr(group_listeners, "ANSWER_S", 0.5)
    monkeypatch.setattr(group_listeners, "RETRY_S", 0.05)
    name = f"listeners-test-{uuid.uuid4().hex[:8]}"
    # socket_timeout as settings.py sets it: redis-py's 5 s default ends channels_redis's blocking read, which
    # would look like a failure and hide what a test waits for.
    layer = RedisChannelLayer(hosts=[{"address": REDIS_URL, "socket_timeout": 10, "client_name": name}],
                              prefix=name)
    listeners = GroupListeners(layer)
    yield listeners
    if stopped := listeners.stop():
        await asyncio.wait(stopped, timeout=WAIT)
    await layer.close_pools()
    client = redis.Redis.from_url(REDIS_URL)
    for key in client.scan_iter(f"{name}*"):
        client.delete(key)


def forget_groups(listeners: GroupListeners, *, drop_connections: bool) -> None:
    """What a Redis that keeps nothing on disk holds of this layer after a restart (and, if asked, the
    connections it dropped)."""
    client = redis.Redis.from_url(REDIS_URL)
    prefix = listeners.layer.prefix
    for key in client.scan_iter(f"{prefix}*"):
        client.delete(key)
    if drop_connections:
        for each in client.client_list():
            if each["name"] == prefix:
                client.client_kill_filter(_id=each["id"])


async def until_heard(layer: RedisChannelLayer, group: str, heard: list) -> None:
    """Send wake-ups until one is heard; fails after a while."""
    async with asyncio.timeout(WAIT * 2):
        while not heard:
            try:
                await layer.group_send(group, wakeup(group))
            except redis.ConnectionError:
                pass  # a pooled connection Redis dropped: the next send takes a new one
            await asyncio.sleep(0.05)


@pytest.mark.parametrize("drop_connections", [True, False], ids=["restarted", "keys lost"])
async def test_a_process_whose_groups_redis_forgot_joins_them_again(on_redis, drop_connections):
    heard: list = []
    await on_redis.join("g", heard.append)
    await until_heard(on_redis.layer, "g", heard)
    heard.clear()
    forget_groups(on_redis, drop_connections=drop_connections)
    await until_heard(on_redis.layer, "g", heard)


async def test_it_joins_its_groups_again_before_the_layer_forgets_them(on_redis, monkeypatch):
    heard: list = []
    await on_redis.join("g", heard.append)
    # One membership expired (group_expiry); the process's own group still answers, so only the refresh helps.
    await on_redis.layer.group_discard("g", on_redis._channel)
    monkeypatch.setattr(group_listeners, "REFRESH_S", 0.05)
    await until_heard(on_redis.layer, "g", heard)
