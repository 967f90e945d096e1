"""Runs of the chat agent: one at a time per thread, each at most once per idempotency key."""

from __future__ import annotations

import logging
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import Q

from chat.models import Message, Run, Thread
from tasks import clock, kicks
from tasks.errors import Conflict
from tasks.models import Tenant

log = logging.getLogger(__name__)
ACTIVE = (Run.Status.PENDING, Run.Status.RUNNING)


class ThreadGoneError(Conflict):
    def __init__(self) -> None:
        super().__init__("the thread was deleted", code="thread_gone")


def start_run(thread: Thread, *, kind: str, user_text: str, hidden: bool, key: str | None,
              task_id: int | None = None, task_version: int = 0, data: dict[str, Any] | None = None) -> tuple[Run, bool]:
    """Store the user turn and a pending run, and kick a worker. (run, created).

    Strategy `reject`: a busy thread raises Conflict(code="thread_busy"). A known key
    returns its run; the unique key index settles a race between two starters.
    """
    if key:
        existing = Run.objects.filter(idempotency_key=key).first()
        if existing is not None:
            return existing, False
    now = clock.now()
    try:
        with transaction.atomic():
            fresh = Thread.objects.select_for_update().filter(pk=thread.pk).first()
            if fresh is None:
                raise ThreadGoneError()
            if Run.objects.filter(thread=fresh, status__in=ACTIVE).exists():
                raise Conflict("the assistant is still answering in this thread", code="thread_busy")
            run = Run.objects.create(thread=fresh, tenant_id=fresh.tenant_id, kind=kind, idempotency_key=key,
                                     input={"text": user_text}, task_id=task_id, task_version=task_version,
                                     created_at=now)
            Message.objects.create(thread=fresh, role=Message.Role.USER, content=user_text, hidden=hidden, run=run,
                                   data=data or {}, created_at=now)
            kicks.kick("run", run.pk)
    except IntegrityError:
        if key and (existing := Run.objects.filter(idempotency_key=key).first()) is not None:
            return existing, False
        # The one-active-run constraint caught a concurrent starter.
        raise Conflict("the assistant is still answering in this thread", code="thread_busy") from None
    _wake_thread(thread)
    return run, True


def lease_seconds() -> float:
    """How long a worker may answer a run before another may take it over; the agent stops before."""
    return settings.LONGHAUL_LEASE_SECONDS * 4


def claim(run_id: int, *, owner: str, now: datetime) -> Run | None:
    """pending (or running with an expired lease) -> running, leased to this worker.

    A run whose workers died LONGHAUL_MAX_ATTEMPTS times is not tried again: it ends
    interrupted, freeing its thread (see `interrupt`), instead of holding it forever.
    Admission: a tenant answers at most LONGHAUL_CHAT_RUNS_PER_TENANT runs at once, oldest first;
    the rest stay pending until one ends (`_kick_next_of_tenant`), so one tenant's chatter cannot
    hold every worker.
    """
    lease = now + timedelta(seconds=lease_seconds())
    due = Q(status=Run.Status.PENDING) | Q(status=Run.Status.RUNNING, lease_expires_at__lt=now)
    with transaction.atomic():
        # Waits for a row another transaction holds, then reads it again: the kick is this run's only hint.
        run = Run.objects.select_for_update().filter(due, pk=run_id).first()
        if run is None:
            return None
        if run.attempts >= settings.LONGHAUL_MAX_ATTEMPTS:
            _interrupt(run, now=now, why=f"gave up after {run.attempts} attempts whose workers never finished")
            return None
        if not _admitted(run, now=now):
            return None
        Run.objects.filter(pk=run.pk, status=run.status, attempts=run.attempts).update(
            status=Run.Status.RUNNING, lease_owner=owner, lease_expires_at=lease, attempts=run.attempts + 1,
            started_at=run.started_at or now)
        run.refresh_from_db()
        return run


def _admitted(run: Run, *, now: datetime) -> bool:
    """Whether the run may start now under its tenant's cap. Inside claim's transaction."""
    # The tenant's row serializes its claims, so two workers cannot both take the last place.
    Tenant.objects.select_for_update().values_list("pk", flat=True).get(pk=run.tenant_id)
    answering = Run.objects.filter(tenant_id=run.tenant_id, status=Run.Status.RUNNING,
                                   lease_expires_at__gte=now).exclude(pk=run.pk).count()
    if answering >= settings.LONGHAUL_CHAT_RUNS_PER_TENANT:
        return False  # kicked again when one of those ends; kick_stale is the safety net
    if run.status == Run.Status.PENDING:
        oldest = _oldest_pending(run.tenant_id)
        if oldest is not None and oldest != run.pk:
            # First come, first answered: the place goes to the oldest, and this one waits its turn.
            kicks.kick("run", oldest)
            return False
    return True


def _oldest_pending(tenant_id: int) -> int | None:
    return Run.objects.filter(tenant_id=tenant_id, status=Run.Status.PENDING).order_by("pk").values_list(
        "pk", flat=True).first()


def _kick_next_of_tenant(tenant_id: int) -> None:
    """A run of the tenant ended: its place goes to the tenant's oldest pending run. After commit."""
    def kick_oldest() -> None:
        if (oldest := _oldest_pending(tenant_id)) is not None:
            kicks.kick("run", oldest)

    transaction.on_commit(kick_oldest)


def _interrupt(run: Run, *, now: datetime, why: str) -> None:
    """pending/running (lease expired) -> interrupted, inside the caller's transaction, with an alert.

    A notification run that is interrupted counts as a failed delivery; a chat turn says so in the thread.
    """
    from tasks import notifications
    from tasks.alerts import raise_alert
    from tasks.models import Alert

    if not Run.objects.filter(pk=run.pk, status=run.status, attempts=run.attempts).update(
            status=Run.Status.INTERRUPTED, error=why[:2000], finished_at=now, lease_owner="", lease_expires_at=None):
        return
    if run.kind == Run.Kind.NOTIFICATION and run.task_id:
        notifications.run_failed(run.task_id, run.task_version, error=f"the notification run was interrupted: {why}",
                                 now=now)
    else:
        Message.objects.create(thread_id=run.thread_id, role=Message.Role.ASSISTANT, run=run, created_at=now,
                               data={"error": True},
                               content="Sorry, I was interrupted several times while answering. Please try again.")
    raise_alert(Alert.Kind.POISON, f"chat run {run.public_id} in a thread of tenant {run.tenant_id} {why}",
                now=now, tenant_id=run.tenant_id)
    thread_id = run.thread_id
    transaction.on_commit(lambda: notifications.kick_pending_in_thread(thread_id))
    _kick_next_of_tenant(run.tenant_id)
    _wake_thread(run.thread)


def complete(run: Run, *, owner: str, reply: str, data: dict[str, Any], now: datetime) -> bool:
    """Store the one assistant message of the run and end it; tell the outbox if it was a notification."""
    from tasks import notifications

    with transaction.atomic():
        if not Run.objects.filter(pk=run.pk, status=Run.Status.RUNNING, lease_owner=owner).update(
                status=Run.Status.SUCCEEDED, finished_at=now, lease_owner="", lease_expires_at=None):
            return False
        Message.objects.create(thread_id=run.thread_id, role=Message.Role.ASSISTANT, content=reply, run=run,
                               data=data, created_at=now)
        if run.kind == Run.Kind.NOTIFICATION and run.task_id:
            notifications.run_finished(run.task_id, run.task_version, now=now)
        transaction.on_commit(lambda: notifications.kick_pending_in_thread(run.thread_id))
        _kick_next_of_tenant(run.tenant_id)
    _wake_thread(run.thread)
    return True


def fail(run: Run, *, owner: str, error: str, now: datetime) -> None:
    from tasks import notifications

    with transaction.atomic():
        if Run.objects.filter(pk=run.pk, status=Run.Status.RUNNING, lease_owner=owner).update(
                status=Run.Status.FAILED, error=error[:2000], finished_at=now, lease_owner="", lease_expires_at=None):
            if run.kind == Run.Kind.NOTIFICATION and run.task_id:
                notifications.run_failed(run.task_id, run.task_version, error=error, now=now)
            else:
                Message.objects.create(thread_id=run.thread_id, role=Message.Role.ASSISTANT, run=run,
                                       created_at=now, data={"error": True},
                                       content="Sorry, something went wrong while answering. Please try again.")
            transaction.on_commit(lambda: notifications.kick_pending_in_thread(run.thread_id))
            _kick_next_of_tenant(run.tenant_id)
    _wake_thread(run.thread)


def watch_held(run_id: int, *, now: datetime) -> None:
    """A kick found the run held by another worker: look again when that lease would expire,
    so a worker that died mid-run frees its thread promptly instead of at the next sweep."""
    expires = Run.objects.filter(pk=run_id, status=Run.Status.RUNNING, lease_expires_at__gte=now).values_list(
        "lease_expires_at", flat=True).first()
    if expires is not None:
        kicks.kick("run", run_id, at=expires + timedelta(milliseconds=500))


def kick_stale(now: datetime) -> int:
    """For the sweeper: runs whose worker died (lease expired) or whose kick was lost."""
    stale = Run.objects.filter(Q(status=Run.Status.RUNNING, lease_expires_at__lt=now)
                               | Q(status=Run.Status.PENDING, created_at__lt=now - timedelta(seconds=10)))
    ids = list(stale.values_list("pk", flat=True)[:500])
    for run_id in ids:
        kicks.kick("run", run_id)
    return len(ids)


def _wake_thread(thread: Thread) -> None:
    from chat.streams import thread_group
    from tasks.events import wake_group

    transaction.on_commit(lambda: wake_group(thread_group(thread.pk)))
