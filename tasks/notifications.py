"""The notification outbox on the task row (DESIGN §7).

`event_version` is the newest event worth telling the user; `notified_version` the
newest told. A delivery job claims a notification lease (separate from the step
lease), freezes the snapshot, and asks the notifier (chat provides it, named in
settings) to start a hidden turn in the task's thread as a run keyed
`task:{id}:{version}:{attempt}`. The key only changes with a new version or after a
failure, so a delivery that crashed half-way and is claimed again finds its run
instead of starting a second one. The run's completion marks the version delivered.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import F, Q
from django.utils.module_loading import import_string

from tasks import clock, kicks, leases
from tasks.alerts import raise_alert
from tasks.models import Alert, Task
from tasks.statuses import NotificationStatus, TaskStatus

log = logging.getLogger(__name__)
N = NotificationStatus
# Statuses whose arrival is worth telling the user in the thread.
TOLD = {TaskStatus.WAITING_INPUT, TaskStatus.PARTIAL, TaskStatus.SUCCEEDED, TaskStatus.FAILED, TaskStatus.CANCELLED}
MAX_FAILURES = 5
BUSY_THREAD_DELAY = timedelta(seconds=2)
PREVIEW_CHARS = 600


@dataclass(frozen=True)
class Delivery:
    """What the notifier gets: whitelisted, nothing internal."""

    task_id: int
    thread_id: int
    version: int
    attempt: int
    snapshot: dict[str, Any]

    @property
    def key(self) -> str:
        return f"task:{self.task_id}:{self.version}:{self.attempt}"


class ThreadBusy(Exception):
    """The thread is running another turn; try again when it is free (not a failure)."""


class ThreadGone(Exception):
    """The thread was deleted; nobody is there to tell."""


def snapshot(task: Task, *, event: str) -> dict[str, Any]:
    """The user-facing facts of an event; its sha256 is the fingerprint."""
    result = task.result if isinstance(task.result, dict) else {}
    preview = str(result.get("report") or result.get("summary") or "")[:PREVIEW_CHARS]
    return {
        "event": event,
        "status": task.status,
        "name": task.name,
        "kind": task.kind,
        "result_version": task.result_version,
        "result_preview": preview,
        "scope": str(result.get("scope") or ""),
        "error_class": task.error_class,
        "error_message": task.error_message[:500],
        "question": task.question,
    }


def fingerprint(snap: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(snap, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def note(task: Task, *, event: str, now: datetime) -> bool:
    """Inside the transaction that made the event true: bump event_version if the snapshot is new.

    A new event on a delivered or dead-lettered row makes it pending again.
    """
    if task.thread_id is None:
        return False  # no conversation to tell; the API and streams still have the events
    fp = fingerprint(snapshot(task, event=event))
    changed = Task.objects.filter(pk=task.pk).exclude(event_fingerprint=fp).update(
        event_fingerprint=fp,
        event_version=F("event_version") + 1,
        notification_status=N.PENDING,
        next_notification_at=now,
    )
    if changed:
        task.event_fingerprint = fp
        kicks.kick("deliver", task.pk)
    return bool(changed)


def _lease_free(now: datetime) -> Q:
    return Q(notification_lease_owner="") | Q(notification_lease_expires_at__lt=now)


def claim(task_id: int, *, owner: str, now: datetime) -> Delivery | None:
    """Take the notification lease of a task with something to deliver now."""
    lease = now + timedelta(seconds=settings.LONGHAUL_LEASE_SECONDS)
    with transaction.atomic():
        task = (
            Task.objects.select_for_update(skip_locked=True)
            .filter(pk=task_id)
            .filter(
                Q(notification_status__in=[N.PENDING, N.RETRY], next_notification_at__lte=now)
                | Q(notification_status=N.CLAIMED, notification_lease_expires_at__lt=now)
            )
            .filter(_lease_free(now))
            .first()
        )
        if task is None or task.thread_id is None:
            return None
        if task.notification_status == N.CLAIMED:
            version, attempt = task.dispatch_version, task.dispatch_attempt  # a claimer died: same key
        else:
            version, attempt = task.event_version, task.notification_attempt_count
        snap = snapshot(task, event=task.status)
        Task.objects.filter(pk=task.pk).update(
            notification_status=N.CLAIMED, notification_lease_owner=owner, notification_lease_expires_at=lease,
            dispatch_version=version, dispatch_attempt=attempt, dispatch_event=snap,
        )
        return Delivery(task_id=task.pk, thread_id=task.thread_id, version=version, attempt=attempt, snapshot=snap)


def _guarded(delivery: Delivery, owner: str) -> Any:
    return Task.objects.filter(pk=delivery.task_id, notification_status=N.CLAIMED, notification_lease_owner=owner,
                               dispatch_version=delivery.version)


def deliver(task_id: int) -> str:
    """The delivery job: claim, hand to the notifier, record what happened."""
    owner = leases.worker_identity()
    now = clock.now()
    delivery = claim(task_id, owner=owner, now=now)
    if delivery is None:
        return "nothing"
    notifier = import_string(settings.LONGHAUL_NOTIFIER)
    try:
        run_id = notifier(delivery)
    except ThreadBusy:
        # Not a failure: back to pending; the thread's current run kicks us when it ends.
        _guarded(delivery, owner).update(notification_status=N.PENDING, notification_lease_owner="",
                                         notification_lease_expires_at=None,
                                         next_notification_at=now + BUSY_THREAD_DELAY)
        kicks.kick("deliver", task_id, at=now + BUSY_THREAD_DELAY)
        return "busy"
    except ThreadGone:
        with transaction.atomic():
            if _guarded(delivery, owner).update(notification_status=N.DEAD_LETTER, notification_lease_owner="",
                                                notification_error="the thread was deleted"):
                _dead_letter_alert(delivery, "its thread was deleted", now=now)
        return "dead_letter"
    except Exception as exc:  # the notifier failed: retry with backoff, then dead-letter
        log.warning("notification of task %s v%s failed", task_id, delivery.version, exc_info=True)
        return _failed(delivery, owner, f"{type(exc).__name__}: {exc}", now=now)
    _guarded(delivery, owner).update(notification_status=N.DISPATCHED, notification_run_id=run_id,
                                     notification_lease_owner="", notification_lease_expires_at=None)
    return "dispatched"


def retry_delay(failures: int) -> timedelta:
    base = settings.LONGHAUL_NOTIFY_RETRY_BASE_SECONDS
    return timedelta(seconds=min(base * 2 ** min(failures, 16), settings.LONGHAUL_NOTIFY_RETRY_CAP_SECONDS))


def _failed(delivery: Delivery, owner: str, error: str, *, now: datetime) -> str:
    failures = delivery.attempt + 1
    with transaction.atomic():
        if failures >= MAX_FAILURES:
            if _guarded(delivery, owner).update(notification_status=N.DEAD_LETTER, notification_lease_owner="",
                                                notification_error=error[:2000],
                                                notification_attempt_count=failures):
                _dead_letter_alert(delivery, f"{failures} delivery attempts failed: {error[:200]}", now=now)
            return "dead_letter"
        run_at = now + retry_delay(failures)
        _guarded(delivery, owner).update(notification_status=N.RETRY, notification_lease_owner="",
                                         notification_lease_expires_at=None, notification_error=error[:2000],
                                         notification_attempt_count=failures, next_notification_at=run_at)
        kicks.kick("deliver", delivery.task_id, at=run_at)
    return "retry"


def _dead_letter_alert(delivery: Delivery, why: str, *, now: datetime) -> None:
    task = Task.objects.get(pk=delivery.task_id)
    raise_alert(Alert.Kind.DEAD_LETTER, f"notification for task {task.name!r} (v{delivery.version}) dead-lettered: "
                f"{why}", now=now, task=task)


def run_finished(task_id: int, version: int, *, now: datetime) -> None:
    """Inside the transaction that stores the notification run's reply: mark the version told.

    If a newer event arrived meanwhile, the row goes back to pending for it.
    """
    task = Task.objects.select_for_update().get(pk=task_id)
    if task.notified_version >= version:
        return
    newer = task.event_version > version
    Task.objects.filter(pk=task_id).update(
        notified_version=version,
        notification_status=N.PENDING if newer else N.DELIVERED,
        next_notification_at=now if newer else None,
        notification_error="",
        # A deliverer that died after starting the run left its lease here; the run's end settles it.
        notification_lease_owner="",
        notification_lease_expires_at=None,
    )
    if newer:
        kicks.kick("deliver", task_id)


def run_failed(task_id: int, version: int, *, error: str, now: datetime) -> None:
    """The notification run failed: count a failure; a retry gets a new key (attempt + 1)."""
    task = Task.objects.select_for_update().get(pk=task_id)
    if task.notification_status not in (N.DISPATCHED, N.CLAIMED) or task.dispatch_version != version:
        return
    failures = task.dispatch_attempt + 1
    Task.objects.filter(pk=task_id).update(notification_lease_owner="", notification_lease_expires_at=None)
    if failures >= MAX_FAILURES:
        Task.objects.filter(pk=task_id).update(notification_status=N.DEAD_LETTER, notification_error=error[:2000],
                                               notification_attempt_count=failures)
        raise_alert(Alert.Kind.DEAD_LETTER, f"notification for task {task.name!r} (v{version}) dead-lettered: "
                    f"{failures} delivery attempts failed: {error[:200]}", now=now, task=task)
        return
    run_at = now + retry_delay(failures)
    Task.objects.filter(pk=task_id).update(notification_status=N.RETRY, notification_error=error[:2000],
                                           notification_attempt_count=failures, next_notification_at=run_at)
    kicks.kick("deliver", task_id, at=run_at)


def retry_dead_letter(task: Task, *, now: datetime) -> bool:
    """An operator's retry: a fresh set of attempts for the newest event."""
    changed = Task.objects.filter(pk=task.pk, notification_status=N.DEAD_LETTER).update(
        notification_status=N.PENDING, notification_attempt_count=0, next_notification_at=now,
        notification_lease_owner="", notification_lease_expires_at=None)
    if changed:
        kicks.kick("deliver", task.pk)
    return bool(changed)


def kick_due(now: datetime, *, limit: int) -> int:
    """For the sweeper: deliveries whose kick was lost or whose claimer died."""
    ids = list(
        Task.objects.filter(
            Q(notification_status__in=[N.PENDING, N.RETRY], next_notification_at__lte=now - timedelta(seconds=5))
            | Q(notification_status=N.CLAIMED, notification_lease_expires_at__lt=now)
        ).values_list("pk", flat=True)[:limit]
    )
    for task_id in ids:
        kicks.kick("deliver", task_id)
    return len(ids)


def kick_pending_in_thread(thread_id: int) -> None:
    """A thread became free: deliveries waiting on it may go now."""
    for task_id in Task.objects.filter(thread_id=thread_id, notification_status=N.PENDING).values_list("pk", flat=True):
        kicks.kick("deliver", task_id)
