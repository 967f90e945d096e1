"""ws/threads/<id>/?after=N: a thread's stream, on tasks' stream protocol (tasks/consumers.py)."""

from __future__ import annotations

import uuid
from typing import Any

from chat.streams import ThreadStream
from tasks.consumers import StreamConsumer
from tasks.streams import Stream


class ThreadStreamConsumer(StreamConsumer):
    """ws/threads/<uuid>/?after=N: status changes of the thread's tasks (see chat.streams.ThreadStream)."""

    subject_kwarg = "thread_id"

    def open_stream(self, user: Any, public_id: uuid.UUID, *, tenant_slug: str | None) -> Stream | None:
        return ThreadStream.open(user, public_id, tenant_slug=tenant_slug)
