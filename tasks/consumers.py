"""WebSocket consumers: ws/tasks/<id>/?after=N, and the base that chat's ws/threads/<id>/ builds on.

Thin: parse the cursor, authorize by session, open the stream, and hand it to a
Follower (tasks/streams.py) that sends every item after the cursor and follows live.
Protocol: each item is one JSON text frame with a `seq` cursor; `{"type": "end", ...}`
says the subject ended and everything so far was sent. Close codes are streams.CloseCode.
`?tenant=<slug>` picks the tenant for a user in several, as X-Longhaul-Tenant does in the API.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from typing import Any
from urllib.parse import parse_qs

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncWebsocketConsumer
from django.core.serializers.json import DjangoJSONEncoder

from tasks.streams import (
    BATCH_SIZE, MAX_BATCHES_BEHIND, CloseCode, Follower, Message, Stream, TaskStream, poll_interval, shared_reader,
)

log = logging.getLogger(__name__)
MAX_CURSOR = 2**62


def parse_cursor(params: dict[str, list[str]]) -> int | None:
    """The `after` query parameter: 0 when absent, None when it is not a cursor."""
    try:
        cursor = int(params.get("after", ["0"])[-1])
    except ValueError:
        return None
    return cursor if 0 <= cursor <= MAX_CURSOR else None


class StreamConsumer(AsyncWebsocketConsumer):
    """Streams one subject's items after the client's cursor; subclasses say which subject."""

    subject_kwarg: str = ""
    # Channel-layer messages that only hint at new items (tasks.events.wake_group sends task.wakeup).
    wakeup_types: frozenset[str] = frozenset({"task.wakeup"})
    batch_size: int = BATCH_SIZE
    max_batches_behind: int = MAX_BATCHES_BEHIND

    def open_stream(self, user: Any, public_id: uuid.UUID, *, tenant_slug: str | None) -> Stream | None:
        """The authorized stream, or None when the subject is missing or not the user's (runs in a thread)."""
        raise NotImplementedError

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
        stream = await database_sync_to_async(self.open_stream)(user, public_id, tenant_slug=tenant_slug)
        if stream is None:
            await self.close(int(CloseCode.NOT_FOUND))
            return
        await self._follow(stream, cursor)

    async def _follow(self, stream: Stream, cursor: int) -> None:
        # Join the group before the first read, so a commit between the two still wakes us.
        await self.channel_layer.group_add(stream.group, self.channel_name)
        self.groups.append(stream.group)  # websocket_disconnect discards it
        self.stream = stream
        self.follower = Follower(
            read=shared_reader(stream, database_sync_to_async(stream.read_after)),
            send=self.send_message,
            cursor=cursor,
            poll_s=poll_interval(self.channel_layer),
            initial_end=stream.initial_end(cursor),
            batch_size=self.batch_size,
            max_batches_behind=self.max_batches_behind,
        )
        self.follow_task = asyncio.create_task(self._run_follower())

    async def _run_follower(self) -> None:
        try:
            code = await self.follower.run()
        except Exception:
            log.exception("stream %s failed", self.stream.group)
            code = CloseCode.INTERNAL_ERROR
        await self.close(int(code))  # autobahn refuses an IntEnum: it would send 1011

    async def send_message(self, message: Message) -> None:
        await self.send(text_data=json.dumps(message, cls=DjangoJSONEncoder))

    async def dispatch(self, message: Message) -> None:
        # Channels runs close_old_connections in the database thread before every handler;
        # a wake-up touches no database (the follower's reads clean up for themselves), and
        # that hop per subscriber per commit is what would crowd out the reads themselves.
        if message["type"] in self.wakeup_types:
            self.stream_wakeup(message)
        else:
            await super().dispatch(message)

    def stream_wakeup(self, message: Message) -> None:
        """A channel-layer hint that the stream may have new items."""
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


class TaskStreamConsumer(StreamConsumer):
    """ws/tasks/<uuid>/?after=N: a task's events with seq > N, then live, then an end message."""

    subject_kwarg = "task_id"

    def open_stream(self, user: Any, public_id: uuid.UUID, *, tenant_slug: str | None) -> Stream | None:
        return TaskStream.open(user, public_id, tenant_slug=tenant_slug)

