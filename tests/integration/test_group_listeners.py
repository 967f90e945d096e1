"""A web process joins each wake-up group once, whatever number of its sockets follow the group, hands each
wake-up to every one of them, leaves the group with its last one, and joins its groups again when the layer
lost them (tasks/group_listeners.py)."""

from __future__ import annotations

import asyncio
import os

import pytest
import redis
from channels.db import database_sync_to_async
from channels.layers import InMemoryChannelLayer, get_channel_layer
from channels_redis.core import RedisChannelLayer

from tasks import events, group_listeners
from tasks.group_listeners import GroupListeners
from tasks.statuses import TaskStatus
from tests.factories import make_task
from tests.integration.test_stream import (  # noqa: F401  (fixtures)
    WAIT,
    _close_consumer_connections,
    _stream_settings,
    alice_cookie,
    append_events,
    connected,
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


def wakeup(group: str, seq: int = 1) -> dict:
    return events.wakeup(group, seq)


async def heard_by(heard: list, count: int) -> None:
    async with asyncio.timeout(WAIT):
        while len(heard) < count:
            await asyncio.sleep(0.01)


async def test_a_listener_that_fails_does_not_deafen_the_others():
    layer = InMemoryChannelLayer()
    listeners, heard = GroupListeners(layer), []

    def failing(message: dict) -> None:
        raise RuntimeError("a stream that broke")

    await listeners.join("g", failing)
    await listeners.join("g", heard.append)
    await layer.group_send("g", wakeup("g", 1))
    await layer.group_send("g", wakeup("g", 2))
    await heard_by(heard, 2)
    assert [message["seq"] for message in heard] == [1, 2]
    listeners.stop()


async def test_a_group_left_by_its_last_listener_while_another_comes_ends_up_joined():
    layer = InMemoryChannelLayer()
    listeners, heard = GroupListeners(layer), []
    leaving = []
    await listeners.join("g", leaving.append)
    await asyncio.gather(listeners.leave("g", leaving.append), listeners.join("g", heard.append))
    assert listeners.groups() == ["g"] and len(layer.groups["g"]) == 1
    await layer.group_send("g", wakeup("g"))
    await heard_by(heard, 1)
    await listeners.leave("g", heard.append)
    assert "g" not in layer.groups and listeners.groups() == []
    listeners.stop()


async def test_it_hears_only_the_groups_it_joined():
    layer = InMemoryChannelLayer()
    listeners, heard = GroupListeners(layer), []
    await listeners.join("g", heard.append)
    await layer.group_add("other", listeners._channel)  # a membership left behind, as a failed leave leaves one
    await layer.group_send("other", wakeup("other"))
    await layer.group_send("g", wakeup("g"))
    await heard_by(heard, 1)
    assert [message["group"] for message in heard] == ["g"]
    listeners.stop()


@pytest.fixture
async def on_redis():
    """Listeners on a Redis layer of their own, stopped after the test."""
    try:
        redis.Redis.from_url(REDIS_URL, socket_connect_timeout=1).ping()
    except redis.RedisError as exc:
        pytest.skip(f"Redis does not answer at {REDIS_URL} ({exc})")
    listeners = GroupListeners(RedisChannelLayer(hosts=[REDIS_URL]))
    yield listeners
    listeners.stop()
    await listeners.layer.close_pools()


async def until_heard(layer: RedisChannelLayer, group: str, heard: list) -> None:
    """Send wake-ups until one is heard; fails after a while."""
    async with asyncio.timeout(WAIT * 2):
        while not heard:
            try:
                await layer.group_send(group, wakeup(group))
            except redis.ConnectionError:
                pass  # a pooled connection Redis dropped: the next send takes a new one
            await asyncio.sleep(0.05)


async def test_after_redis_restarted_and_forgot_its_groups_it_joins_them_again(on_redis, monkeypatch):
    monkeypatch.setattr(group_listeners, "RETRY_S", 0.05)
    heard: list = []
    await on_redis.join("g", heard.append)
    await until_heard(on_redis.layer, "g", heard)
    heard.clear()
    client = redis.Redis.from_url(REDIS_URL)
    client.flushdb()  # what a Redis that keeps nothing on disk holds after a restart
    client.client_kill_filter(_type="normal")  # and the connections it dropped
    await until_heard(on_redis.layer, "g", heard)


async def test_it_joins_its_groups_again_before_the_layer_forgets_them(on_redis, monkeypatch):
    monkeypatch.setattr(group_listeners, "REFRESH_S", 0.05)
    heard: list = []
    await on_redis.join("g", heard.append)
    redis.Redis.from_url(REDIS_URL).flushdb()  # the membership expired (group_expiry), the connection stayed
    await until_heard(on_redis.layer, "g", heard)
