"""The notifier the task runtime calls (settings.LONGHAUL_NOTIFIER): a hidden turn in the task's thread."""

from __future__ import annotations

import json

from chat import runs
from chat.models import Run, Thread
from tasks.errors import Conflict
from tasks.gateway.untrusted import frame
from tasks.notifications import Delivery, ThreadBusy, ThreadGone

INSTRUCTION = ("A background task the user started in this conversation has news. Tell the user plainly what "
               "happened, by the task's name, without ids.")


def deliver(delivery: Delivery) -> int:
    """Start the notification run (or find the one this key already started); returns its id."""
    thread = Thread.objects.filter(pk=delivery.thread_id).first()
    if thread is None:
        raise ThreadGone()
    text = f"{INSTRUCTION}\n\n{frame(json.dumps(delivery.snapshot, sort_keys=True), origin='task event')}"
    try:
        run, _ = runs.start_run(thread, kind=Run.Kind.NOTIFICATION, user_text=text, hidden=True, key=delivery.key,
                                task_id=delivery.task_id, task_version=delivery.version)
    except runs.ThreadGoneError:
        raise ThreadGone() from None
    except Conflict:
        raise ThreadBusy() from None
    return run.pk


def run_state(key: str) -> str:
    """What became of the notification run started with `key`: active, succeeded, failed or missing."""
    status = Run.objects.filter(idempotency_key=key).values_list("status", flat=True).first()
    if status is None:
        return "missing"
    if status in (Run.Status.PENDING, Run.Status.RUNNING):
        return "active"
    return "succeeded" if status == Run.Status.SUCCEEDED else "failed"
