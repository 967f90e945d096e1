"""The API's shapes as the client hands them over (plain dicts, typed for readers and checkers).

The server's serializers (tasks/serializers.py) are the source of truth; fields it adds later
arrive in the dicts too, so these are deliberately not exhaustive (total=False).
"""

from __future__ import annotations

from typing import Any, TypedDict

# Statuses after which nothing more happens (tasks.statuses.TERMINAL).
TERMINAL = frozenset({"succeeded", "failed", "cancelled"})
# Statuses in which the task waits for a person: an answer, a resume, or a decision about a partial result.
WAITS_FOR_PERSON = frozenset({"waiting_input", "paused", "partial"})


class Task(TypedDict, total=False):
    id: str
    kind: str
    name: str
    status: str
    priority: int
    thread: str | None
    input: dict[str, Any]
    budget: dict[str, Any]
    question: str
    question_fields: list[dict[str, Any]]
    error_class: str
    error_message: str
    current_step: int
    waiting_reason: str
    is_terminal: bool
    result_version: int
    last_event_seq: int
    created_at: str
    started_at: str | None
    finished_at: str | None
    updated_at: str


class Event(TypedDict):
    seq: int
    kind: str
    status: str
    at: str
    data: Any


class EventPage(TypedDict):
    results: list[Event]
    next_after: int


class Result(TypedDict):
    id: str
    status: str
    result: Any
    result_version: int


class End(TypedDict):
    """The stream's last word: the task ended with this status (tasks.streams.end_message)."""

    type: str
    status: str
    result_version: int
