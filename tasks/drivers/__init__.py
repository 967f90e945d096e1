"""What a task kind does, step by step. Drivers know nothing of HTTP, WebSockets or the admin.

A driver gets the checkpoint state and a StepContext, and returns the next state
(Continue) or the end (Finish). It fails by raising a StepError subclass, whose
class decides between a retry and a failure.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from django.conf import settings

from tasks.errors import InvalidInput
from tasks.events import NewEvent

if TYPE_CHECKING:
    from tasks.context import StepContext
    from tasks.models import Task, Tenant


@dataclass(frozen=True)
class OpRequest:
    """A model or tool call a step wants; a gateway job runs it, and the next step reads its outcome."""

    kind: str  # "model" or "tool"
    name: str  # the model call's purpose, or the tool's name
    args: dict[str, Any]


@dataclass(frozen=True)
class Continue:
    state: dict[str, Any]
    events: list[NewEvent] = field(default_factory=list)
    requests: list[OpRequest] = field(default_factory=list)


@dataclass(frozen=True)
class Finish:
    state: dict[str, Any]
    result: dict[str, Any]
    events: list[NewEvent] = field(default_factory=list)


@dataclass(frozen=True)
class Ask:
    """Stop and ask the task's owner; the next step runs once they answer (ctx.answer)."""

    state: dict[str, Any]
    question: str
    events: list[NewEvent] = field(default_factory=list)


@dataclass(frozen=True)
class Wait:
    """Nothing to do until `until` (a remote job's next poll): the task keeps its slot, holds no worker,
    and a delayed kick brings it back. `tracking_degraded`, when not None, sets the task's flag."""

    state: dict[str, Any]
    until: datetime
    events: list[NewEvent] = field(default_factory=list)
    tracking_degraded: bool | None = None


Outcome = Continue | Finish | Ask | Wait


@dataclass(frozen=True)
class PartialResult:
    result: dict[str, Any]
    scope: str


class Driver(Protocol):
    kind: ClassVar[str]
    schema_version: ClassVar[int]
    debug_only: ClassVar[bool]

    def validate_input(self, raw: Any, *, tenant: Tenant | None = None) -> dict[str, Any]: ...

    def initial_state(self, task_input: dict[str, Any]) -> dict[str, Any]: ...

    def step(self, state: dict[str, Any], ctx: StepContext) -> Outcome: ...

    def partial_result(self, state: dict[str, Any]) -> PartialResult | None: ...


class RemoteCancelling(Protocol):
    """A driver whose work lives on a remote server that must be told to stop (DESIGN §10).

    While its task is asked to cancel, the runner runs `cancel_step` instead of `step`
    until it returns None (the remote stopped, or is gone); a step result that arrives
    after the request is discarded rather than committed.
    """

    def remote_to_cancel(self, task_id: int, state: dict[str, Any]) -> bool: ...

    def cancel_step(self, state: dict[str, Any], ctx: StepContext) -> Wait | None: ...

    def abandon(self, task: Task, state: dict[str, Any] | None) -> None:
        """Best effort, once: tell the remote to stop, when the task ends for another reason (its budget)."""
        ...


def _registry() -> dict[str, Driver]:
    from tasks.drivers.mcp import McpDriver
    from tasks.drivers.research import ResearchDriver
    from tasks.drivers.sleep import SleepDriver

    drivers: list[Driver] = [McpDriver(), ResearchDriver(), SleepDriver()]
    return {d.kind: d for d in drivers}


_DRIVERS: dict[str, Driver] | None = None


def get_driver(kind: str) -> Driver:
    """The driver for a task kind; unknown kinds (and debug kinds when disabled) are bad input."""
    global _DRIVERS
    if _DRIVERS is None:
        _DRIVERS = _registry()
    driver = _DRIVERS.get(kind)
    if driver is None or (driver.debug_only and not settings.LONGHAUL_DEBUG_DRIVERS):
        raise InvalidInput(f"unknown task kind {kind!r}; known kinds: {', '.join(available_kinds())}", field="kind")
    return driver


def remote_cancelling(driver: Driver | None) -> RemoteCancelling | None:
    return driver if driver is not None and hasattr(driver, "cancel_step") else None  # type: ignore[return-value]


def available_kinds() -> list[str]:
    global _DRIVERS
    if _DRIVERS is None:
        _DRIVERS = _registry()
    return sorted(k for k, d in _DRIVERS.items() if settings.LONGHAUL_DEBUG_DRIVERS or not d.debug_only)
