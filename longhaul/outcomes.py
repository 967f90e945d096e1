"""Exit codes of the `longhaul` command: one per outcome, so a script can branch without parsing text."""

from __future__ import annotations

from enum import IntEnum

from longhaul.errors import (
    AmbiguousName,
    ApiError,
    AuthenticationFailed,
    ConnectionFailed,
    LonghaulError,
    NotFound,
    NotSignedIn,
    ServerError,
)


class Exit(IntEnum):
    OK = 0  # done; for --wait and watch: the task succeeded
    TASK_FAILED = 1
    USAGE = 2  # a bad option or argument, or a name that matches several tasks
    TASK_CANCELLED = 3
    TASK_PARTIAL = 4  # ended with part of the work (budget, or cancelled keeping results)
    NEEDS_PERSON = 5  # waits for an answer (waiting_input) or a resume (paused)
    NOT_SIGNED_IN = 6  # no login stored, or the server refused the token
    NOT_FOUND = 7  # no such task id or name (or not yours)
    REFUSED = 8  # the server refused the request: invalid input, conflict, forbidden, queue full
    UNREACHABLE = 9  # network down, timeout, or the server failing (5xx)
    INTERRUPTED = 130  # Ctrl-C: the task goes on


MEANING = {
    Exit.OK: "done (with --wait or watch: the task succeeded)",
    Exit.TASK_FAILED: "the task failed",
    Exit.USAGE: "bad usage, or a name that matches several tasks (they are listed)",
    Exit.TASK_CANCELLED: "the task was cancelled",
    Exit.TASK_PARTIAL: "the task ended partial",
    Exit.NEEDS_PERSON: "the task waits for a person (an answer, or a resume)",
    Exit.NOT_SIGNED_IN: "not signed in, or the token was refused",
    Exit.NOT_FOUND: "no such task",
    Exit.REFUSED: "the server refused the request (invalid input, conflict, forbidden, queue full)",
    Exit.UNREACHABLE: "the server cannot be reached, or is failing",
    Exit.INTERRUPTED: "interrupted (Ctrl-C); the task goes on",
}
# Shown by `longhaul --help`; "\b" asks click to keep the rows as they are instead of refolding them.
EXIT_CODES_HELP = "\b\nExit codes:\n" + "\n".join(f"  {int(code):>3}  {text}" for code, text in MEANING.items())

_BY_STATUS = {
    "succeeded": Exit.OK,
    "failed": Exit.TASK_FAILED,
    "cancelled": Exit.TASK_CANCELLED,
    "partial": Exit.TASK_PARTIAL,
    "waiting_input": Exit.NEEDS_PERSON,
    "paused": Exit.NEEDS_PERSON,
}


def for_status(status: str) -> Exit:
    """The exit code of a command that waited for a task now in `status`."""
    return _BY_STATUS.get(status, Exit.OK)


def for_error(exc: LonghaulError) -> Exit:
    if isinstance(exc, NotSignedIn | AuthenticationFailed):
        return Exit.NOT_SIGNED_IN
    if isinstance(exc, NotFound):
        return Exit.NOT_FOUND
    if isinstance(exc, AmbiguousName):
        return Exit.USAGE
    if isinstance(exc, ConnectionFailed | ServerError):
        return Exit.UNREACHABLE
    if isinstance(exc, ApiError):
        return Exit.REFUSED
    return Exit.REFUSED
