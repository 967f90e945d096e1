"""WebSocket consumers: ws/tasks/<id>/?after=N, and the base that chat's ws/threads/<id>/ builds on.

Thin: parse the cursor, authorize by session, open the stream, and hand it to a
Follower (tasks/streams.py) that sends every item after the cursor and follows live.
Protocol: each item is one JSON text frame with a `seq` cursor; `{"type": "end", ...}`
says the subject ended and everything so far was sent. Close codes are streams.CloseCode.
`?tenant=<slug>` picks the tenant for a user in several, as X-Longhaul-Tenant does in the API.

Guards against floods and stale sockets:
- a socket takes a slot of its user's and its tenant's limits (project/socket_limits.py); one
  over either is closed with 4429, after a `{"type": "close", "code", "reason", "retry_after"}`
  frame, since daphne drops close reasons on the way to the client;
- the stream's reads and checks run in tasks/read_threads.py, not on the one thread that every
  thread-sensitive database call of Channels queues on;
- every LONGHAUL_WS_REAUTH_SECONDS the socket is authorized again: signed out (4401), no longer a
  member of the tenant (4403), or the subject deleted or no longer visible (4404) closes it,
  after the same kind of close frame.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from dataclasses import dataclass
from typing import Any, NamedTuple
from urllib.parse import parse_qs

from channels.generic.websocket import AsyncWebsocketConsumer
from django.conf import settings
from django.core.serializers.json import DjangoJSONEncoder

from project.socket_limits import HEARTBEAT_S, Slot, socket_slots
from project.ws_credentials import Credential, credential_of, still_signed_in
from tasks.group_listeners import group_listeners
from tasks.models import Membership
from tasks.read_threads import read_threads
from tasks.streams import (
    BATCH_SIZE,
    MAX_BATCHES_BEHIND,
    CloseCode,
    Follower,
    Message,
    Stream,
    TaskStream,
    poll_interval,
    shared_reader,
)
from tasks.tenancy import tenant_for

log = logging.getLogger(__name__)
MAX_CURSOR = 2**62


def parse_cursor(params: dict[str, list[str]]) -> int | None:
    """The `after` query parameter: 0 when absent, None when it is not a cursor."""
    try:
        cursor = int(params.get("after", ["0"])[-1])
    except ValueError:
        return None
    return cursor if 0 <= cursor <= MAX_CURSOR else None


@dataclass(frozen=True)
class Grant:
    """What a socket was allowed at connect: kept to authorize it again while it stays open."""

    user: Any
    tenant_id: int
    tenant_slug: str
    public_id: uuid.UUID
    credential: Credential | None
    stream: Stream


class Ending(NamedTuple):
    """Why a socket is closed: the code, and a reason when the client can act on one."""

    code: CloseCode
    reason: str = ""
    retry_after_s: int | None = None


class StreamConsumer(AsyncWebsocketConsumer):
    """Streams one subject's items after the client's cursor; subclasses say which subject."""

    subject_kwarg: str = ""
    batch_size: int = BATCH_SIZE
    max_batches_behind: int = MAX_BATCHES_BEHIND
    slot: Slot | None = None  # held from an accepted connect until the socket closes

    def open_stream(self, user: Any, public_id: uuid.UUID, *, tenant_slug: str | None) -> Stream | None:
        """The authorized stream, or None when the subject is missing or not the user's (runs in a thread)."""
        raise NotImplementedError

    def authorize(self, user: Any, public_id: uuid.UUID, *, tenant_slug: str | None) -> Grant | None:
        """The grant to stream the subject, or None when it is missing or not the user's (runs in a thread)."""
        tenant = tenant_for(user, slug=tenant_slug)
        if tenant is None:
            return None
        # Pinned to the tenant found now: a later check must not drift to the user's next-oldest tenant.
        stream = self.open_stream(user, public_id, tenant_slug=tenant.slug)
        if stream is None:
            return None
        return Grant(user, tenant.pk, tenant.slug, public_id, credential_of(self.scope, user), stream)

    def reauthorize(self, grant: Grant) -> Ending | None:
        """Why the grant no longer holds, or None while it does (runs in a thread)."""
        if not still_signed_in(grant.credential, grant.user.pk):
            return Ending(CloseCode.UNAUTHENTICATED, "signed out; sign in again")
        if not Membership.objects.filter(user_id=grant.user.pk, tenant_id=grant.tenant_id).exists():
            return Ending(CloseCode.FORBIDDEN, "no longer a member of this tenant")
        if self.open_stream(grant.user, grant.public_id, tenant_slug=grant.tenant_slug) is None:
            return Ending(CloseCode.NOT_FOUND, "deleted, or no longer visible to you")
        return None

    async def connect(self) -> None:
        # Accept first: a handshake refused before accept reaches a browser as a bare 1006,
        # and the client needs the code to know whether reconnecting can help.
        await self.accept()
        user = self.scope.get("user")
        if not getattr(user, "is_authenticated", False):
            await self.close(int(CloseCode.UNAUTHENTICATED))
            return
        params = parse_qs(self.scope.get("query_string", b"").decode("latin1"))
        cursor = parse_cursor(params)
        if cursor is None:
            await self.close(int(CloseCode.BAD_REQUEST))
            return
        # Browsers cannot set headers on a WebSocket: `tenant` plays the API's X-Longhaul-Tenant.
        tenant_slug = params.get("tenant", [None])[-1]
        public_id = self.scope["url_route"]["kwargs"][self.subject_kwarg]
        grant = await read_threads().to_async(self.authorize)(user, public_id, tenant_slug=tenant_slug)
        if grant is None:
            await self.close(int(CloseCode.NOT_FOUND))
            return
        slot = Slot(uuid.uuid4().hex, user.pk, grant.tenant_id)
        refusal = await socket_slots().acquire(slot)
        if refusal is not None:
            await self._end(Ending(CloseCode.TOO_MANY, refusal.reason, refusal.retry_after_s))
            return
        self.slot = slot
        self.grant = grant
        await self._follow(grant.stream, cursor)

    async def _follow(self, stream: Stream, cursor: int) -> None:
        self.stream = stream
        self.follower = Follower(
            read=shared_reader(stream, read_threads().to_async(stream.read_after)),
            send=self.send_message,
            cursor=cursor,
            poll_s=poll_interval(self.channel_layer),
            initial_end=stream.initial_end(cursor),
            batch_size=self.batch_size,
            max_batches_behind=self.max_batches_behind,
        )
        # Listen before the first read, so a commit between the two still wakes us.
        listeners = group_listeners(self.channel_layer)
        try:
            await listeners.join(stream.group, self.stream_wakeup)
        except Exception:  # the layer is away: the client reconnects with its cursor, as after any 4500
            log.exception("listening to %s failed", stream.group)
            await self._end(Ending(CloseCode.INTERNAL_ERROR))
            return
        self.listeners = listeners
        self.follow_task = asyncio.create_task(self._stay_open())

    async def _stay_open(self) -> None:
        """Follow the stream and keep the grant checked until either says the socket must close."""
        follow = asyncio.ensure_future(self._until_follower_stops())
        guard = asyncio.ensure_future(self._until_grant_lapses())
        try:
            done, _ = await asyncio.wait({follow, guard}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (follow, guard):
                task.cancel()
            await asyncio.gather(follow, guard, return_exceptions=True)
        await self._end(done.pop().result())

    async def _until_follower_stops(self) -> Ending:
        try:
            return Ending(await self.follower.run())
        except Exception:
            log.exception("stream %s failed", self.stream.group)
            return Ending(CloseCode.INTERNAL_ERROR)

    async def _until_grant_lapses(self) -> Ending:
        # One timer for both jobs: the slot's heartbeat, and the re-check on its own (usually slower) cadence.
        reauth_s = settings.LONGHAUL_WS_REAUTH_SECONDS
        tick_s = min(reauth_s, HEARTBEAT_S)
        ticks_per_check = max(1, round(reauth_s / tick_s))
        tick = 0
        try:
            while True:
                await asyncio.sleep(tick_s)
                tick += 1
                if tick % ticks_per_check == 0:
                    ending = await read_threads().to_async(self.reauthorize)(self.grant)
                    if ending is not None:
                        return ending
                if self.slot is not None:
                    await socket_slots().refresh(self.slot)
        except Exception:
            log.exception("re-checking stream %s failed", self.stream.group)
            return Ending(CloseCode.INTERNAL_ERROR)

    async def _end(self, ending: Ending) -> None:
        """Free the slot and close; a reason goes first as a frame, since daphne drops the close frame's."""
        await self._release_slot()
        if ending.reason:
            frame: Message = {"type": "close", "code": int(ending.code), "reason": ending.reason}
            if ending.retry_after_s is not None:
                frame["retry_after"] = ending.retry_after_s
            await self.send_message(frame)
        # int(): autobahn refuses an IntEnum and would send 1011.
        await self.close(int(ending.code), ending.reason or None)

    async def _release_slot(self) -> None:
        slot, self.slot = self.slot, None
        if slot is not None:
            # Shielded: a disconnect that cancels us mid-release must not leave the slot taken until it expires.
            await asyncio.shield(socket_slots().release(slot))

    async def send_message(self, message: Message) -> None:
        await self.send(text_data=json.dumps(message, cls=DjangoJSONEncoder))

    def stream_wakeup(self, message: Message) -> None:
        """A channel-layer hint that the stream may have new items (from tasks/group_listeners.py)."""
        follower = getattr(self, "follower", None)
        if follower is not None:
            follower.wake(self.stream.announced_seq(message))

    async def receive(self, text_data: str | None = None, bytes_data: bytes | None = None) -> None:
        """Clients send nothing; frames are ignored rather than answered."""

    async def disconnect(self, code: int) -> None:
        task = getattr(self, "follow_task", None)
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        # Shielded: a disconnect cancelled half-way must still free the slot (else taken until it expires) and
        # stop listening (else the socket's consumer is kept, and the group joined, for as long as the process).
        await asyncio.shield(self._let_go())

    async def _let_go(self) -> None:
        listeners = getattr(self, "listeners", None)
        if listeners is not None:
            await listeners.leave(self.stream.group, self.stream_wakeup)
        await self._release_slot()


class TaskStreamConsumer(StreamConsumer):
    """ws/tasks/<uuid>/?after=N: a task's events with seq > N, then live, then an end message."""

    subject_kwarg = "task_id"

    def open_stream(self, user: Any, public_id: uuid.UUID, *, tenant_slug: str | None) -> Stream | None:
        return TaskStream.open(user, public_id, tenant_slug=tenant_slug)

