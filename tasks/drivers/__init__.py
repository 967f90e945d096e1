"""What a task kind does, step by step. Drivers know nothing of HTTP, WebSockets or the admin.

A driver gets the checkpoint state and a StepContext, and returns the next state
(Continue, with the calls it wants made) or the end (Finish). It fails by raising a
StepError subclass, whose class decides between a retry and a failure. A step never
waits on the network: every model, tool or MCP call is an OpRequest that a gateway
job runs, and the next step reads its outcome (ctx.requested_outcomes()).
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
    """A call a step wants; a gateway job runs it, and the next step reads its outcome."""

    kind: str  # the pool: "model", "tool" or "mcp"
    name: str  # the model call's purpose, the tool's name, or the MCP method
    args: dict[str, Any]
    not_before: datetime | None = None  # not run before then (a remote job's next poll); None: at once
    once: bool = False  # must never run twice: a gateway job that dies during it fails it instead


@dataclass(frozen=True)
class RemoteFacts:
    """What a step learned about its remote task, stored on the task row in the step's commit.
    None leaves a column as it is; "" clears a text."""

    handle: str | None = None  # the remote task id: unique per owner and server, never shown
    server: str | None = None  # the configured server's name, with the handle
    poll_error: str | None = None  # the last poll error, redacted and bounded by the driver
    cancel_attempts: int | None = None  # remote cancel attempts made so far
    cancel_error: str | None = None  # why the last remote cancel attempt failed


@dataclass(frozen=True)
class Continue:
    """The next state; with requests, the task waits (holding no worker) until a gateway job has run them all.
    `tracking_degraded`, when not None, sets or clears the task's remote-tracking flag."""

    state: dict[str, Any]
    events: list[NewEvent] = field(default_factory=list)
    requests: list[OpRequest] = field(default_factory=list)
    tracking_degraded: bool | None = None
    remote: RemoteFacts | None = None


@dataclass(frozen=True)
class Finish:
    state: dict[str, Any]
    result: dict[str, Any]
    events: list[NewEvent] = field(default_factory=list)
    remote: RemoteFacts | None = None


@dataclass(frozen=True)
class Ask:
    """Stop and ask the task's owner; the next step runs once they answer (ctx.answer, ctx.answer_data).

    `form`: the requested schema of a structured answer (None: free text). `watch`: a call that
    runs while the task waits for its owner (a slow poll of a remote task); when it finishes and
    the driver's `question_stands(state, result)` says the question is gone, the question is
    withdrawn and the next step reads the call's outcome."""

    state: dict[str, Any]
    question: str
    events: list[NewEvent] = field(default_factory=list)
    remote: RemoteFacts | None = None
    form: dict[str, Any] | None = None
    watch: OpRequest | None = None


Outcome = Continue | Finish | Ask


@dataclass(frozen=True)
class PartialResult:
    result: dict[str, Any]
    scope: str


@dataclass(frozen=True)
class Pins:
    """What a task's behaviour depends on besides Longhaul's code and its checkpoint schema: recorded
    on the task when it is submitted (Task.model_name, prompt_version, tool_protocol), so a result
    can be traced to the model, prompts and protocol that made it. Empty where a kind uses none."""

    model_name: str = ""
    prompt_version: str = ""
    tool_protocol: str = ""


class Driver(Protocol):
    kind: ClassVar[str]
    schema_version: ClassVar[int]
    debug_only: ClassVar[bool]

    def pins(self) -> Pins: ...

    def validate_input(self, raw: Any, *, tenant: Tenant | None = None, internal: bool = False) -> dict[str, Any]:
        """The stored input, or InvalidInput naming the field. `internal`: see actions.Submission."""

    def initial_state(self, task_input: dict[str, Any]) -> dict[str, Any]: ...

    def step(self, state: dict[str, Any], ctx: StepContext) -> Outcome: ...

    def partial_result(self, state: dict[str, Any]) -> PartialResult | None: ...


class RemoteCancelling(Protocol):
    """A driver whose work lives on a remote server that must be told to stop (DESIGN §10).

    While its task is asked to cancel, the runner runs `cancel_step` instead of `step`:
    each round reads the previous round's outcomes and requests its calls, like a step,
    until it returns None or a Continue without requests (the remote stopped, is gone, or
    did not confirm in time), and the task ends cancelled. A step result that arrives
    after the request is discarded rather than committed.
    """

    def remote_to_cancel(self, task_id: int, state: dict[str, Any] | None) -> bool: ...

    def cancel_step(self, state: dict[str, Any], ctx: StepContext) -> Continue | None: ...

    def question_stands(self, state: dict[str, Any], result: Any) -> bool:
        """Whether an Ask's `watch` call, finished with `result`, still shows the asked question open;
        False withdraws the question and the next step reads the call's outcome."""
        ...

    def abandon(self, task: Task, state: dict[str, Any] | None) -> list[OpRequest]:
        """The calls that tell the remote to stop, once, when the task ends for another reason (its budget,
        an error): requested in the transaction that ends it, so a worker fenced out requests nothing."""
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
