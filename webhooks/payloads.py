"""What a delivery says: the event and the task's public projection (the API's task shape), frozen
when the event happened. Whitelists only: no internal ids, no remote handles."""

from __future__ import annotations

import json
from typing import Any

from rest_framework.utils.encoders import JSONEncoder

from tasks.models import Task, TaskEvent
from tasks.serializers import EventSerializer, TaskSerializer


def payload(task: Task, event: TaskEvent, *, event_type: str) -> dict[str, Any]:
    """The Standard Webhooks payload shape: type, timestamp, data."""
    return {
        "type": event_type,
        "timestamp": event.at.isoformat(),
        "data": {
            "task": TaskSerializer(task).data,
            "event": EventSerializer(event).data,
        },
    }


def body(task: Task, event: TaskEvent, *, event_type: str) -> str:
    """The exact bytes every attempt of the delivery sends and signs."""
    return json.dumps(payload(task, event, event_type=event_type), cls=JSONEncoder, ensure_ascii=False,
                      separators=(",", ":"))
