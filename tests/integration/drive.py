"""Drive the runtime in-process, as a worker would, without a broker in between."""

from __future__ import annotations

from datetime import timedelta

import time_machine

from tasks import clock, jobs
from tasks.models import Task
from tasks.statuses import TERMINAL, TaskStatus


def drive(task: Task, *, max_advances: int = 200, travel: bool = True) -> Task:
    """Call advance until the task ends or stops; jump the clock to a retry's due time."""
    for _ in range(max_advances):
        task.refresh_from_db()
        if task.status in TERMINAL or task.status in (TaskStatus.PAUSED, TaskStatus.PARTIAL, TaskStatus.QUEUED):
            return task
        if task.next_run_at and task.next_run_at > clock.now():
            if not travel:
                return task
            with time_machine.travel(task.next_run_at + timedelta(milliseconds=10), tick=True):
                jobs.advance(task.pk)
            continue
        jobs.advance(task.pk)
    task.refresh_from_db()
    return task
