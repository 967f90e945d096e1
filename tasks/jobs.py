"""The functions django-q2 executes. Each re-reads the truth from the database;
the message that started it is only a hint."""

from __future__ import annotations

import logging
from datetime import timedelta

from tasks import clock, drain, gateway_thread, kicks, leases, notifications, runner, sweeper
from tasks.models import Task
from tasks.statuses import CLAIMABLE

log = logging.getLogger(__name__)
WATCHDOG_MARGIN = timedelta(milliseconds=500)


def advance(task_id: int) -> None:
    """Claim the task (kicks.DUE_LONGEST: the task due longest) if a step is due and run it; otherwise do
    nothing."""
    with drain.job():
        if drain.draining.is_set():
            kicks.kick("advance", task_id)  # hand the hint on to a worker that is not stopping
            return
        owner = leases.worker_identity()
        now = clock.now()
        if task_id == kicks.DUE_LONGEST:
            task = leases.claim_due_longest(owner=owner, now=now)
        else:
            task = leases.claim(task_id, owner=owner, now=now)
            if task is None:
                _watch_held_lease(task_id, now=now)
                # A kick is a hint that steps are due: when another worker took this one, take the task due longest.
                task = leases.claim_next(owner=owner, now=now)
        if task is not None:
            runner.run(task, owner=owner)


def run_operations(task_id: int) -> None:
    """A gateway job: run due model and tool calls (of any task; the id is only who asked), on a thread beside
    this worker's jobs (tasks/gateway_thread.py), and return: the worker takes the next job while the calls
    are out. Nothing to start while a thread of this process holds the turn: it claims them.

    On PostgreSQL one gateway job claims at a time per turn (LONGHAUL_GATEWAY_TURNS, one by default); a job
    that finds every turn taken ends at once (see tasks/operations.py)."""
    with drain.job():
        if drain.draining.is_set():
            kicks.kick("operations", task_id)
            return
        if not gateway_thread.start():
            log.debug("gateway job for task %s: this process's gateway thread holds the turn", task_id)


def deliver(task_id: int) -> None:
    """Deliver the task's newest notification into its thread (tasks/notifications.py)."""
    with drain.job():
        notifications.deliver(task_id)


def _watch_held_lease(task_id: int, *, now) -> None:
    """A kick found the task held by another worker: look again when that lease would expire,
    so a holder that died is replaced promptly instead of at the next sweep."""
    row = (
        Task.objects.filter(pk=task_id, status__in=CLAIMABLE, lease_expires_at__gte=now)
        .exclude(lease_owner="")
        .values("lease_expires_at")
        .first()
    )
    if row is not None:
        kicks.kick("advance", task_id, at=row["lease_expires_at"] + WATCHDOG_MARGIN)


def sweep() -> dict[str, int]:
    """The periodic safety net (a django-q2 schedule): see tasks/sweeper.py."""
    counts = sweeper.run_once(now=clock.now())
    if any(counts.values()):
        log.info("sweep: %s", counts)
    return counts
