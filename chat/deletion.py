"""Deleting a thread (DESIGN §14): its tasks first, then the thread with its messages, runs, proposals
and stream items. Tasks that may still run are cancelled and follow once they end (tasks/deletion.py)."""

from __future__ import annotations

from typing import Any

from django.db import transaction

from chat.models import Thread
from tasks import actions, clock, deletion, notifications


def delete_thread(thread: Thread, *, user: Any) -> dict[str, Any]:
    """Delete the thread and everything in it; returns what its audit entry keeps: counts, never content."""
    now = clock.now()
    with transaction.atomic():
        deletion.lock_runs(thread_id=thread.pk)  # runs, then the thread, then its tasks: the order runs take
        fresh = Thread.objects.select_for_update().get(pk=thread.pk)
        counts, pending = deletion.delete_tasks(fresh.tasks.all(), user=user, now=now)
        # The tasks left to end their cancel lose their thread (SET NULL), and with it anyone to tell.
        notifications.nobody_to_tell(fresh.tasks.all())
        _, rows = fresh.delete()
        counts.update(deletion.named_counts(rows))
        details = {"deleted": dict(sorted(counts.items())), "tasks_pending": pending}
        actions.audit(fresh, user, "thread.delete", now, details)
    return details
