"""The notification outbox on the task row (DESIGN §7), a state machine of guarded transitions.

`event_version` is the newest event worth telling the user; `notified_version` the
newest told. A delivery job claims a notification lease (separate from the step
lease), freezes the snapshot, and asks the notifier (chat provides it, named in
settings) to start a hidden turn in the task's thread as a run keyed
`task:{id}:{version}:{attempt}`. The key only changes with a new version or a new
delivery, so a delivery that crashed half-way and is claimed again finds its run
instead of starting a second one. The run's completion marks the version delivered.

    none/delivered/dead_letter --note--> pending --claim--> claimed --dispatch--> dispatched --delivered--> delivered
    claimed --busy--> pending (not a failure, up to a ceiling)   claimed --gone--> dead_letter
    claimed/dispatched --failed--> retry (then claimed again) or, after MAX_FAILURES, dead_letter

Each transition below is one conditional UPDATE guarded by the state it expects (and,
for the deliverer, its lease's owner and expiry) and returns whether it won. The
failure count belongs to one version: a newer event and a delivery reset it.
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
from django.db.models import F, Q, QuerySet
from django.utils.module_loading import import_string

from tasks import clock, kicks, leases
from tasks.alerts import raise_alert
from tasks.models import Alert, Task
from tasks.sealed import Sealed
from tasks.statuses import NotificationStatus, TaskStatus

log = logging.getLogger(__name__)
N = NotificationStatus
# Statuses whose arrival is worth telling the user in the thread.
TOLD = {TaskStatus.WAITING_INPUT, TaskStatus.PARTIAL, TaskStatus.SUCCEEDED, TaskStatus.FAILED, TaskStatus.CANCELLED}
MAX_FAILURES = 5
BUSY_THREAD_DELAY = timedelta(seconds=2)
PREVIEW_CHARS = 600
# How long after a dispatch the sweeper looks whether its run ended without telling the outbox.
DISPATCH_WATCH = timedelta(minutes=10)


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

    A new event on a delivered or dead-lettered row makes it pending again, with a fresh set of
    attempts: an earlier version's failures are not this one's.
    """
    if task.thread_id is None:
        return False  # no conversation to tell; the API and streams still have the events
    fp = fingerprint(snapshot(task, event=event))
    changed = Task.objects.filter(pk=task.pk).exclude(event_fingerprint=fp).update(
        event_fingerprint=fp,
        event_version=F("event_version") + 1,
        notification_status=N.PENDING,
        next_notification_at=now,
        notification_attempt_count=0,
        notification_deferrals=0,
    )
    if changed:
        task.event_fingerprint = fp
        kicks.kick("deliver", task.pk)
    return bool(changed)


def nobody_to_tell(tasks: QuerySet[Task]) -> int:
    """These tasks' thread is gone (or going): their outbox settles, with no delivery due or held."""
    return tasks.update(notification_status=N.NONE, next_notification_at=None, **_released())


def _lease_free(now: datetime) -> Q:
    return Q(notification_lease_owner="") | Q(notification_lease_expires_at__lt=now)


def _released() -> dict[str, Any]:
    return {"notification_lease_owner": "", "notification_lease_expires_at": None}


def claim(task_id: int, *, owner: str, now: datetime) -> Delivery | None:
    """pending/retry (due), or claimed by a deliverer that died -> claimed, leased to `owner`.

    Waits for a row another transaction holds (a step's commit, a recorder), then reads it again: the
    kick is this delivery's only hint, and skipped, the thread would hear of the task at the next sweep."""
    lease = now + timedelta(seconds=settings.LONGHAUL_LEASE_SECONDS)
    with transaction.atomic():
        task = (
            Task.objects.select_for_update()
            .filter(pk=task_id)
            .filter(
                Q(notification_status__in=[N.PENDING, N.RETRY], next_notification_at__lte=now)
                | Q(notification_status=N.CLAIMED, notification_lease_expires_at__lt=now)
            )
            .filter(_lease_free(now))
            .first()
        )
        if task is None:
            return None
        if task.thread_id is None:
            # Its thread was deleted (SET NULL) behind the deletions that settle the outbox (an admin's
            # delete, say): a pending row would be kicked for ever.
            nobody_to_tell(Task.objects.filter(pk=task.pk))
            return None
        dispatches = task.notification_dispatches
        if task.notification_status == N.CLAIMED:
            version, attempt = task.dispatch_version, task.dispatch_attempt  # a claimer died: same key
        else:
            version, attempt = task.event_version, dispatches + 1
            dispatches = attempt
        snap = snapshot(task, event=task.status)
        Task.objects.filter(pk=task.pk, notification_status=task.notification_status).update(
            notification_status=N.CLAIMED, notification_lease_owner=owner, notification_lease_expires_at=lease,
            dispatch_version=version, dispatch_attempt=attempt, dispatch_event=Sealed(task.tenant_id, snap),
            notification_dispatches=dispatches,
        )
        return Delivery(task_id=task.pk, thread_id=task.thread_id, version=version, attempt=attempt, snapshot=snap)


def _held(delivery: Delivery, owner: str, now: datetime) -> Any:
    """The row as this deliverer claimed it, while its lease lasts: owner and expiry both checked."""
    return Task.objects.filter(pk=delivery.task_id, notification_status=N.CLAIMED, notification_lease_owner=owner,
                               notification_lease_expires_at__gte=now, dispatch_version=delivery.version)


def defer_busy(delivery: Delivery, owner: str, *, now: datetime) -> str:
    """claimed -> pending: the thread is running another turn. Not a failure, up to a ceiling;
    a thread busy past it (a run that never ends) counts as a failed delivery."""
    with transaction.atomic():
        row = _held(delivery, owner, now).select_for_update().values("notification_deferrals").first()
        if row is None:
            return "lost"
        deferrals = row["notification_deferrals"] + 1
        if deferrals > settings.LONGHAUL_NOTIFY_MAX_DEFERRALS:
            return fail(delivery, owner, f"the thread stayed busy through {deferrals - 1} tries", now=now)
        _held(delivery, owner, now).update(notification_status=N.PENDING, notification_deferrals=deferrals,
                                           next_notification_at=now + BUSY_THREAD_DELAY, **_released())
        kicks.kick("deliver", delivery.task_id, at=now + BUSY_THREAD_DELAY)
    return "busy"


def dispatch(delivery: Delivery, owner: str, *, now: datetime) -> bool:
    """claimed -> dispatched: the notification run exists; its end marks delivery. Watched from
    `DISPATCH_WATCH` on, so a run that disappears or ends without telling us is noticed."""
    return bool(_held(delivery, owner, now).update(notification_status=N.DISPATCHED,
                                                   next_notification_at=now + DISPATCH_WATCH, **_released()))


def dead_letter_gone(delivery: Delivery, owner: str, *, now: datetime) -> bool:
    """claimed -> dead_letter at once: the thread was deleted, nobody is there to tell."""
    with transaction.atomic():
        won = bool(_held(delivery, owner, now).update(notification_status=N.DEAD_LETTER, next_notification_at=None,
                                                      notification_error="the thread was deleted", **_released()))
        if won:
            _dead_letter_alert(delivery.task_id, delivery.version, "its thread was deleted", now=now)
    return won


def fail(delivery: Delivery, owner: str, error: str, *, now: datetime) -> str:
    """claimed -> retry with backoff, or dead_letter after MAX_FAILURES for this version."""
    with transaction.atomic():
        row = _held(delivery, owner, now).select_for_update().values("notification_attempt_count").first()
        if row is None:
            return "lost"
        return _count_failure(_held(delivery, owner, now), delivery.task_id, delivery.version,
                              row["notification_attempt_count"] + 1, error, now=now)


def _count_failure(rows: Any, task_id: int, version: int, failures: int, error: str, *, now: datetime) -> str:
    if failures >= MAX_FAILURES:
        if rows.update(notification_status=N.DEAD_LETTER, notification_error=error[:2000],
                       notification_attempt_count=failures, next_notification_at=None, **_released()):
            _dead_letter_alert(task_id, version, f"{failures} delivery attempts failed: {error[:200]}", now=now)
            return "dead_letter"
        return "lost"
    run_at = now + retry_delay(failures)
    if not rows.update(notification_status=N.RETRY, notification_error=error[:2000],
                       notification_attempt_count=failures, next_notification_at=run_at, **_released()):
        return "lost"
    kicks.kick("deliver", task_id, at=run_at)
    return "retry"


def deliver(task_id: int) -> str:
    """The delivery job: claim, hand to the notifier, record what happened."""
    owner = leases.worker_identity()
    now = clock.now()
    delivery = claim(task_id, owner=owner, now=now)
    if delivery is None:
        return "nothing"
    notifier = import_string(settings.LONGHAUL_NOTIFIER)
    try:
        notifier(delivery)
    except ThreadBusy:
        # Not a failure: back to pending; the thread's current run kicks us when it ends.
        return defer_busy(delivery, owner, now=clock.now())
    except ThreadGone:
        return "dead_letter" if dead_letter_gone(delivery, owner, now=clock.now()) else "lost"
    except Exception as exc:  # the notifier failed: retry with backoff, then dead-letter
        log.warning("notification of task %s v%s failed", task_id, delivery.version, exc_info=True)
        return fail(delivery, owner, f"{type(exc).__name__}: {exc}", now=clock.now())
    return "dispatched" if dispatch(delivery, owner, now=clock.now()) else "lost"


def retry_delay(failures: int) -> timedelta:
    base = settings.LONGHAUL_NOTIFY_RETRY_BASE_SECONDS
    return timedelta(seconds=min(base * 2 ** min(failures, 16), settings.LONGHAUL_NOTIFY_RETRY_CAP_SECONDS))


def _dead_letter_alert(task_id: int, version: int, why: str, *, now: datetime) -> None:
    task = Task.objects.get(pk=task_id)
    raise_alert(Alert.Kind.DEAD_LETTER, f"notification for task {task.name!r} (v{version}) dead-lettered: {why}",
                now=now, task=task)


def run_finished(task_id: int, version: int, *, now: datetime) -> bool:
    """Inside the transaction that stores the notification run's reply: mark the version told
    (-> delivered, or pending when a newer event arrived meanwhile). Attempts start afresh."""
    task = Task.objects.select_for_update().get(pk=task_id)
    if task.notified_version >= version:
        return False
    newer = task.event_version > version
    won = Task.objects.filter(pk=task_id, notified_version=task.notified_version).update(
        notified_version=version,
        notification_status=N.PENDING if newer else N.DELIVERED,
        next_notification_at=now if newer else None,
        notification_error="",
        notification_attempt_count=0,
        notification_deferrals=0,
        # A deliverer that died after starting the run left its lease here; the run's end settles it.
        **_released(),
    )
    if won and newer:
        kicks.kick("deliver", task_id)
    return bool(won)


def run_failed(task_id: int, version: int, *, error: str, now: datetime) -> str:
    """dispatched (or claimed by a deliverer that died after starting the run) -> retry or dead_letter:
    the notification run failed or was interrupted. A retry gets a new key (a new delivery)."""
    task = Task.objects.select_for_update().get(pk=task_id)
    if task.notification_status not in (N.DISPATCHED, N.CLAIMED) or task.dispatch_version != version:
        return "stale"
    rows = Task.objects.filter(pk=task_id, notification_status=task.notification_status, dispatch_version=version)
    return _count_failure(rows, task_id, version, task.notification_attempt_count + 1, error, now=now)


def retry_dead_letter(task: Task, *, now: datetime) -> bool:
    """dead_letter -> pending: an operator's retry, a fresh set of attempts for the newest event."""
    changed = Task.objects.filter(pk=task.pk, notification_status=N.DEAD_LETTER).update(
        notification_status=N.PENDING, notification_attempt_count=0, notification_deferrals=0,
        next_notification_at=now, **_released())
    if changed:
        kicks.kick("deliver", task.pk)
    return bool(changed)


def dispatched_run_state(task: Task) -> str:
    """What became of a dispatched notification's run: active, succeeded, failed or missing (the notifier knows)."""
    state = import_string(settings.LONGHAUL_NOTIFIER_RUN_STATE)
    return str(state(f"task:{task.pk}:{task.dispatch_version}:{task.dispatch_attempt}"))


def watch_again(task: Task, *, now: datetime) -> bool:
    """dispatched -> dispatched, looked at again later: its run is still going."""
    return bool(Task.objects.filter(pk=task.pk, notification_status=N.DISPATCHED,
                                    dispatch_version=task.dispatch_version).update(
        next_notification_at=now + DISPATCH_WATCH))


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
