"""Wake-ups through Redis leave the committing thread: the process's sender thread delivers them
after commit, the latest seq of a group last, and nothing for a transaction that rolled back."""

from __future__ import annotations

import asyncio
import os

import pytest
import redis
from channels.layers import get_channel_layer
from django.db import transaction

from tasks import events
from tasks.events import NewEvent
from tasks.models import Task
from tasks.statuses import TaskStatus
from tests.factories import submit_sleep

pytestmark = pytest.mark.django_db(transaction=True)
REDIS_URL = os.environ.get("LONGHAUL_TEST_REDIS_URL", "redis://127.0.0.1:6379/5")


@pytest.fixture(autouse=True)
def redis_layer(settings):
    try:
        redis.Redis.from_url(REDIS_URL, socket_connect_timeout=1).ping()
    except redis.RedisError as exc:
        pytest.skip(f"Redis does not answer at {REDIS_URL} ({exc})")
    settings.CHANNEL_LAYERS = {"default": {"BACKEND": "channels_redis.core.RedisChannelLayer",
                                           "CONFIG": {"hosts": [REDIS_URL]}}}


def append_one(task: Task, *, roll_back: bool = False) -> None:
    class RolledBack(Exception):
        pass

    try:
        with transaction.atomic():
            locked = Task.objects.select_for_update().get(pk=task.pk)
            events.append(locked, [NewEvent("note", {})], status=locked.status, at=locked.created_at)
            if roll_back:
                raise RolledBack
    except RolledBack:
        pass


async def received_seqs(channel: str, *, until: int, timeout: float = 5) -> list[int]:
    layer = get_channel_layer()
    seqs: list[int] = []
    async with asyncio.timeout(timeout):
        while not seqs or seqs[-1] < until:
            seqs.append((await layer.receive(channel))["seq"])
    return seqs


def test_it_delivers_the_wakeups_of_committed_events_through_redis(acme, alice):
    task = submit_sleep(acme, alice, steps=1)
    Task.objects.filter(pk=task.pk).update(status=TaskStatus.RUNNING)
    task.refresh_from_db()
    assert events.wakeup_sender().drain(timeout=5), "the submission's own wake-ups are out"
    layer = get_channel_layer()

    async def subscribe() -> str:
        channel = await layer.new_channel()
        await layer.group_add(events.task_group(task.public_id), channel)
        return channel

    channel = asyncio.run(subscribe())
    first = task.last_event_seq
    append_one(task, roll_back=True)  # a rolled back event wakes nobody
    for _ in range(20):
        append_one(task)
    last = Task.objects.get(pk=task.pk).last_event_seq
    assert last == first + 20
    seqs = asyncio.run(received_seqs(channel, until=last))
    assert seqs[-1] == last
    assert seqs == sorted(seqs) and len(seqs) <= 20, "wake-ups queued behind a send merge into one"
    assert all(seq > first for seq in seqs), "the rolled-back append sent nothing"


def test_a_burst_of_wakeups_never_runs_out_of_redis_connections(caplog):
    # A commit that touches hundreds of tasks (a bulk submission, a tenant's cancel) hands over as many
    # wake-ups at once: the sender must not open a connection for each, beyond the pool's 100.
    groups = [f"burst-{n}" for n in range(400)]
    with caplog.at_level("WARNING", logger="tasks.events"):
        for group in groups:
            events.wake_group(group, seq=1)
        assert events.wakeup_sender().drain(timeout=20)
    assert not [r for r in caplog.records if "failed" in r.getMessage()], caplog.records[:3]
