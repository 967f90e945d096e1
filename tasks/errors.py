"""The runtime's exceptions. Callers decide by type, never by message text."""

from __future__ import annotations

from typing import Any

from tasks.statuses import ErrorClass


class LonghaulError(Exception):
    """Base of every error the runtime raises on purpose."""


class InvalidTransition(LonghaulError):
    def __init__(self, task_id: object, current: str, target: str) -> None:
        super().__init__(f"task {task_id}: {current} -> {target} is not allowed")
        self.current = current
        self.target = target


class LeaseLost(LonghaulError):
    """The worker's fencing token is no longer the task's: another worker owns it now."""


class Conflict(LonghaulError):
    def __init__(self, message: str, *, code: str) -> None:
        super().__init__(message)
        self.code = code


class InvalidInput(LonghaulError):
    """A request the runtime refuses; `field` names the offending part."""

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class QuotaExceeded(LonghaulError):
    """A submission refused for a full queue (429). `rule` names which limit refused it."""

    def __init__(self, message: str, *, retry_after: int, rule: str = "queue_full") -> None:
        super().__init__(message)
        self.retry_after = retry_after
        self.rule = rule


class StepError(LonghaulError):
    """Raised by a driver step; the class decides retry or failure."""

    error_class: ErrorClass = ErrorClass.INTERNAL
    retryable = False

    def __init__(self, message: str, *, detail: str = "") -> None:
        super().__init__(message)
        self.detail = detail


class TransientError(StepError):
    error_class = ErrorClass.TRANSIENT
    retryable = True


class RateLimited(StepError):
    error_class = ErrorClass.RATE_LIMITED
    retryable = True

    def __init__(self, message: str, *, retry_after: float | None = None, detail: str = "") -> None:
        super().__init__(message, detail=detail)
        self.retry_after = retry_after


class StepTimeout(StepError):
    error_class = ErrorClass.TIMEOUT
    retryable = True


class InternalError(StepError):
    """A bug or an unexpected exception in a step: retried from the checkpoint, within the budget."""

    error_class = ErrorClass.INTERNAL
    retryable = True


class BudgetExhausted(StepError):
    """A model-call, tool-call or token budget is used up; the task ends partial or failed.

    `state` is the step's state when it ran out, so what the step learned still counts."""

    error_class = ErrorClass.BUDGET_EXHAUSTED

    def __init__(self, message: str, *, state: dict | None = None) -> None:
        super().__init__(message)
        self.state = state


class PermanentError(StepError):
    error_class = ErrorClass.PERMANENT


class RemoteFailed(PermanentError):
    """A remote tool finished with an error result: the task fails, and that result is kept."""

    def __init__(self, message: str, *, result: dict[str, Any]) -> None:
        super().__init__(message)
        self.result = result


class RemoteCancelled(StepError):
    """The remote server cancelled the work on its own: the task ends cancelled."""

    error_class = ErrorClass.CANCELLED


class SafePoint(LonghaulError):
    """Control flow: the step stopped at a safe point because the user asked it to."""


class CancelRequested(SafePoint):
    pass


class PauseRequested(SafePoint):
    pass


class TamperedContent(LonghaulError):
    """A sealed value failed its integrity check (tasks/crypto.py): changed, truncated, or moved from another
    column or tenant. Raised, never returned as a value."""
