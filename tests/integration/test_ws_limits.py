"""Stream sockets under floods and lapsed grants: per-user and per-tenant caps (4429 naming the limit),
reads off Channels' shared thread, and authorization checked again while a socket stays open."""

from __future__ import annotations

import json
import threading
from typing import Any

import pytest
from asgiref.sync import SyncToAsync, sync_to_async
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator
from django.conf import settings as django_settings
from django.test import Client
from redis.asyncio import Redis
from rest_framework.authtoken.models import Token

from chat.models import Thread
from project import socket_limits
from project.asgi import application
from tasks.models import Membership, Task
from tasks.statuses import TaskStatus
from tasks.streams import CloseCode, TaskStream
from tests.conftest import api_client_for
from tests.factories import make_task
from tests.integration.test_stream import (  # noqa: F401  (fixtures)
    ORIGIN,
    WAIT,
    _close_consumer_connections,
    _stream_settings,
    append_events,
    connected,
    session_cookie,
    stream,
    task_path,
)

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
async def _fresh_slots(settings, monkeypatch):
    """Every test starts with no slot taken, in Redis (only this code's keys) or in memory."""
    settings.LONGHAUL_WS_MAX_PER_USER = 2
    settings.LONGHAUL_WS_MAX_PER_TENANT = 3
    settings.LONGHAUL_WS_REAUTH_SECONDS = 3600  # the re-check tests lower it
    monkeypatch.setattr(socket_limits, "_local", socket_limits.LocalSlots())
    await _forget_redis_slots()
    yield
    await _forget_redis_slots()


async def _forget_redis_slots() -> None:
    if not django_settings.REDIS_URL:
        return
    redis = Redis.from_url(django_settings.REDIS_URL)
    try:
        keys = [key async for key in redis.scan_iter(match=f"{socket_limits.KEY_PREFIX}:*")]
        if keys:
            await redis.delete(*keys)
    finally:
        await redis.aclose()


@pytest.fixture
def reauth_quickly(settings) -> None:
    settings.LONGHAUL_WS_REAUTH_SECONDS = 0.05


async def output(comm: WebsocketCommunicator) -> dict[str, Any]:
    """The next message as JSON, or {"closed": code, "reason": reason} when the server closes."""
    message = await comm.receive_output(timeout=WAIT)
    if message["type"] == "websocket.close":
        return {"closed": message.get("code"), "reason": message.get("reason", "")}
    assert message["type"] == "websocket.send", message
    return json.loads(message["text"])


async def closed_with(comm: WebsocketCommunicator) -> tuple[dict[str, Any], dict[str, Any]]:
    """The close frame and the close itself, which a server-side close sends in that order (items before them skipped)."""
    frame = await output(comm)
    while "seq" in frame:
        frame = await output(comm)
    close = await output(comm)
    await comm.disconnect()
    return frame, close


async def cookie_of(user) -> bytes:
    return await sync_to_async(session_cookie)(user)


def make_running_task(tenant, user, **fields: Any) -> Task:
    """A running task with one event: a socket that sent it has been authorized and holds its slot."""
    task = make_task(tenant, user, status=TaskStatus.RUNNING, **fields)
    append_events(task, 1, kind="admitted")
    return task


async def running_task(tenant, user) -> Task:
    return await database_sync_to_async(make_running_task)(tenant, user)


async def live(comm: WebsocketCommunicator) -> WebsocketCommunicator:
    """The socket, once it has sent its first item: past authorization, holding a slot, following."""
    await connected(comm)
    first = await output(comm)
    assert "seq" in first, first
    return comm


async def open_streams(task: Task, cookie: bytes, count: int) -> list[WebsocketCommunicator]:
    return [await live(stream(task_path(task), cookie)) for _ in range(count)]


async def disconnect_all(comms: list[WebsocketCommunicator]) -> None:
    for comm in comms:
        await comm.disconnect()


# --- caps ------------------------------------------------------------------------

async def test_it_refuses_a_users_socket_over_the_limit_with_4429_naming_it(acme, alice):
    task, cookie = await running_task(acme, alice), await cookie_of(alice)
    held = await open_streams(task, cookie, 2)
    frame, close = await closed_with(await connected(stream(task_path(task), cookie)))
    await disconnect_all(held)
    reason = "at most 2 live streams per user; close a tab or retry in 30 s"
    assert frame == {"type": "close", "code": 4429, "reason": reason, "retry_after": 30}
    assert close == {"closed": CloseCode.TOO_MANY, "reason": reason}


async def test_it_lets_another_user_of_the_tenant_in_until_the_tenants_limit(acme, alice, bob, charlie, globex):
    alices = await open_streams(await running_task(acme, alice), await cookie_of(alice), 2)
    bobs_task, bobs_cookie = await running_task(acme, bob), await cookie_of(bob)
    bobs = await open_streams(bobs_task, bobs_cookie, 1)  # alice is at her limit; bob is not
    frame, close = await closed_with(await connected(stream(task_path(bobs_task), bobs_cookie)))
    charlies = await open_streams(await running_task(globex, charlie), await cookie_of(charlie), 2)
    await disconnect_all(alices + bobs + charlies)
    assert frame["reason"] == "at most 3 live streams per tenant; close a tab or retry in 30 s"
    assert close["closed"] == CloseCode.TOO_MANY


async def assert_refused(task: Task, cookie: bytes) -> None:
    _, close = await closed_with(await connected(stream(task_path(task), cookie)))
    assert close["closed"] == CloseCode.TOO_MANY


async def test_it_frees_a_slot_when_a_socket_closes(acme, alice):
    task, cookie = await running_task(acme, alice), await cookie_of(alice)
    first, second = await open_streams(task, cookie, 2)
    await first.disconnect()
    third = await open_streams(task, cookie, 1)
    await assert_refused(task, cookie)  # the limit still holds: the slot was freed, not forgotten
    await disconnect_all([second, *third])


async def test_it_takes_back_a_slot_whose_process_stopped_refreshing_it(acme, alice):
    if not django_settings.REDIS_URL:
        pytest.skip("slots expire in Redis only; in memory they die with their process")
    slots = socket_limits.socket_slots()
    dead = socket_limits.Slot("from-a-dead-process", alice.pk, acme.pk)
    assert await slots.acquire(dead) is None
    redis = Redis.from_url(django_settings.REDIS_URL)
    try:
        for key in dead.keys:  # as if its last heartbeat was long ago
            await redis.zadd(key, {dead.socket_id: 1})
    finally:
        await redis.aclose()
    task, cookie = await running_task(acme, alice), await cookie_of(alice)
    held = await open_streams(task, cookie, 2)
    await assert_refused(task, cookie)
    await disconnect_all(held)


# --- authorization while open ------------------------------------------------------

async def test_it_closes_an_open_socket_when_the_user_signs_out(acme, alice, reauth_quickly):
    client = Client()
    await sync_to_async(client.force_login)(alice)
    cookie = f"{django_settings.SESSION_COOKIE_NAME}={client.cookies[django_settings.SESSION_COOKIE_NAME].value}"
    comm = await live(stream(task_path(await running_task(acme, alice)), cookie.encode()))
    response = await sync_to_async(client.post)("/accounts/logout/")
    assert response.status_code == 302
    frame, close = await closed_with(comm)
    assert frame == {"type": "close", "code": 4401, "reason": "signed out; sign in again"}
    assert close["closed"] == CloseCode.UNAUTHENTICATED


async def test_it_closes_a_token_socket_when_the_token_is_deleted(acme, alice, reauth_quickly):
    token, _ = await database_sync_to_async(Token.objects.get_or_create)(user=alice)
    headers = [ORIGIN, (b"authorization", f"Token {token.key}".encode())]
    task = await running_task(acme, alice)
    comm = await live(WebsocketCommunicator(application, task_path(task), headers=headers))
    await database_sync_to_async(token.delete)()
    frame, close = await closed_with(comm)
    assert (frame["code"], close["closed"]) == (4401, CloseCode.UNAUTHENTICATED)


async def test_it_closes_an_open_socket_when_the_membership_is_removed(acme, alice, reauth_quickly):
    comm = await live(stream(task_path(await running_task(acme, alice)), await cookie_of(alice)))
    await database_sync_to_async(Membership.objects.filter(user=alice, tenant=acme).delete)()
    frame, close = await closed_with(comm)
    assert frame == {"type": "close", "code": 4403, "reason": "no longer a member of this tenant"}
    assert close["closed"] == CloseCode.FORBIDDEN


async def test_it_closes_a_thread_socket_when_the_thread_is_deleted(acme, alice, reauth_quickly):
    thread = await database_sync_to_async(Thread.objects.create)(tenant=acme, owner=alice, title="Research")
    await database_sync_to_async(make_running_task)(acme, alice, thread=thread)
    comm = await live(stream(f"/ws/threads/{thread.public_id}/?after=0", await cookie_of(alice)))
    api = await database_sync_to_async(api_client_for)(alice)
    response = await sync_to_async(api.delete)(f"/api/threads/{thread.public_id}")
    assert response.status_code == 204, response.content
    frame, close = await closed_with(comm)
    assert frame == {"type": "close", "code": 4404, "reason": "deleted, or no longer visible to you"}
    assert close["closed"] == CloseCode.NOT_FOUND


async def test_it_keeps_a_socket_open_while_its_grant_holds(acme, alice, reauth_quickly):
    comm = await live(stream(task_path(await running_task(acme, alice)), await cookie_of(alice)))
    assert await comm.receive_nothing(timeout=0.5), "several re-checks pass without closing"
    await comm.disconnect()


# --- reads off the shared thread ---------------------------------------------------------

async def test_it_reads_the_stream_off_the_thread_that_channels_database_calls_share(acme, alice, monkeypatch):
    read_in: list[threading.Thread] = []
    read_after = TaskStream.read_after

    def recording_read_after(self, cursor, limit):
        read_in.append(threading.current_thread())
        return read_after(self, cursor, limit)

    monkeypatch.setattr(TaskStream, "read_after", recording_read_after)
    comm = await live(stream(task_path(await running_task(acme, alice)), await cookie_of(alice)))
    await comm.disconnect()
    shared = SyncToAsync.single_thread_executor.submit(threading.current_thread).result()
    # A consumer runs in no request context: its thread-sensitive database calls all queue on that one thread.
    assert await database_sync_to_async(threading.current_thread)() is shared
    assert read_in, "the first item was read"
    assert shared not in read_in
