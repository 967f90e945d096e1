"""Stopping a task as its owner asked (cancel, cancel keeping results, pause), at a safe point.

Shared by the door (tasks/actions.py: a task nobody holds stops at once), the worker
(tasks/runner.py: a held task stops at its next safe point) and the liveness repair, so the
door never imports the worker.
"""

from __future__ import annotations

from datetime import datetime

from tasks import kicks, transitions
from tasks.drivers import Driver, get_driver, remote_cancelling
from tasks.errors import InvalidInput, LeaseLost
from tasks.models import Checkpoint, Task, Tenant
from tasks.statuses import HOLDS_SLOT, TaskStatus


def latest_checkpoint(task: Task) -> Checkpoint | None:
    return Checkpoint.objects.filter(task_id=task.pk).order_by("-step").first()


def stop_as_requested(task: Task, *, now: datetime, token: int | None = None) -> None:
    """End a task that was asked to cancel or pause. A cancel that asked to keep results
    ends `partial` with what the last checkpoint can deliver. Without a token, only a
    task nobody holds can be stopped (the transition checks)."""
    if task.cancel_requested_at:
        remote = remote_cancelling(driver_or_none(task.kind))
        if remote is not None:
            checkpoint = latest_checkpoint(task)
            if remote.remote_to_cancel(task.pk, checkpoint.state if checkpoint else None):
                _stop_remote_work(task, now=now, token=token)
                return
        partial = None
        if task.cancel_keep_results:
            checkpoint = latest_checkpoint(task)
            driver = driver_or_none(task.kind)
            if checkpoint is not None and driver is not None:
                partial = driver.partial_result(checkpoint.state)
        if partial is not None:
            won = transitions.finish_partial(task, now=now, token=token, result=partial.result,
                                             scope=partial.scope, reason="cancelled")
        else:
            won = transitions.cancel(task, now=now, token=token)
    else:
        won = transitions.pause(task, now=now, token=token)
    if token is not None:
        must_win(won)


def reads_checkpoint(task: Task) -> bool:
    """Whether stopping `task` as asked reads its last checkpoint (stop_as_requested): a cancel keeping
    results reads what it keeps, and a cancel of a kind that stops remote work reads whether there is any."""
    return bool(task.cancel_requested_at) and (
        task.cancel_keep_results or remote_cancelling(driver_or_none(task.kind)) is not None)


def _stop_remote_work(task: Task, *, now: datetime, token: int | None) -> None:
    """Cancel rounds take a running slot: a task that holds one runs them now; one that holds none
    (queued, paused, waiting for input) queues for one, first in its tenant (DESIGN §4 admission).
    It waits at most as long as its tenant's running tasks take to end or yield (their budgets bound it)."""
    # A tenant whose max_running is 0 (frozen by its admin) would never give one: the cancel runs at once.
    if task.status in HOLDS_SLOT or not Tenant.objects.filter(pk=task.tenant_id, max_running__gt=0).exists():
        won = transitions.stop_remote(task, now=now, token=token)
        if token is not None:
            must_win(won)
        if won:
            kicks.kick("advance", task.pk)
    elif task.status != TaskStatus.QUEUED or task.waiting_reason != transitions.CANCEL_WAIT:
        transitions.queue_for_cancel(task, now=now)  # admission kicks it when it gets its slot


def driver_or_none(kind: str) -> Driver | None:
    try:
        return get_driver(kind)
    except InvalidInput:
        return None


def must_win(won: bool) -> None:
    # The row is locked and fenced: losing here means the row changed under the lock.
    if not won:
        raise LeaseLost("transition lost under the row lock")
