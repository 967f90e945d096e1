"""The webhook delivery outbox (DESIGN §7's discipline, §15), a state machine of guarded transitions.

One Delivery row per (endpoint, task, event version); the version is the task event's seq. Rows
are written in the transaction that appends the event (tasks.events.on_append), so an event and
its deliveries commit or roll back together, and so does the kick that sends them.

    (event) --enqueue--> pending --claim--> claimed --delivered--> delivered
    claimed --fail--> retry --claim--> claimed ...   or, on the last attempt, dead_letter (+ alert)
    claimed --fail (address refused: sending again cannot help)--> dead_letter (+ alert)
    claimed, lease expired (the deliverer died) --claim--> claimed again: same webhook-id, next attempt;
        dead_letter (+ alert) instead when its attempts ran out (a delivery that kills its worker)
    pending/retry/dead_letter --a newer event of the task for the endpoint--> superseded
    dead_letter --an operator's retry--> pending, with a fresh set of attempts

Each transition is one conditional UPDATE guarded by the state it expects (and, for the deliverer,
its lease: owner and attempt number) and returns whether it won. Attempts count claims, so a
killed attempt counts too and nothing loops forever. A disabled endpoint's rows wait, pending,
until it is enabled again: nothing claims or kicks them meanwhile.
"""

from __future__ import annotations

import logging
import random
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import connection, transaction
from django.db.models import Q, QuerySet

from tasks import kicks, prepared
from tasks.alerts import raise_alert
from tasks.models import Alert, Task, TaskEvent
from webhooks import payloads, signing
from webhooks.models import EVENT_TYPES, Delivery, DeliveryStatus, Endpoint

log = logging.getLogger(__name__)
D = DeliveryStatus
JOB = "webhook"
# A row due for less than this is probably being kicked right now; the sweeper does not pile on.
KICK_GRACE = timedelta(seconds=5)
# The lease watchdog's kick comes this long after the lease would expire.
WATCHDOG_MARGIN = timedelta(milliseconds=500)
SUPERSEDABLE = (D.PENDING, D.RETRY, D.DEAD_LETTER)


@dataclass(frozen=True)
class Claimed:
    """A delivery as its deliverer holds it: what to send, where, signed with which secrets."""

    delivery_id: int
    endpoint_id: int
    task_id: int
    event_seq: int
    attempt: int
    webhook_id: str
    url: str
    body: str
    signing_secrets: list[str]
    watchdog_kick: int


# --- enqueue: inside the transaction that appends the task's events ---------------------


def on_events(task: Task, events: Sequence[TaskEvent]) -> None:
    """tasks.events listener: queue a delivery for each endpoint that wants one of these events.

    Most batches hold no such event and cost nothing. A failure here must not undo the task's
    transition: it rolls back to a savepoint, is logged and raises an alert instead.
    """
    wanted = [event for event in events if event.kind in EVENT_TYPES]
    if not wanted or not _anyone_listening(task):
        return
    endpoints = list(listening(task))
    if not endpoints:  # removed or disabled since the probe
        return
    try:
        with transaction.atomic():
            enqueue(task, wanted, endpoints)
    except Exception:
        log.exception("webhook deliveries for task %s could not be queued", task.pk)
        raise_alert(Alert.Kind.DEAD_LETTER, f"webhook deliveries for task {task.name!r} (event "
                    f"#{wanted[-1].seq}) could not be queued; see the worker log", now=wanted[-1].at, task=task)


def listening(task: Task) -> QuerySet[Endpoint]:
    """Enabled endpoints that may hear of this task: the tenant's, tenant-wide or its owner's own."""
    return Endpoint.objects.filter(tenant_id=task.tenant_id, enabled=True).filter(
        Q(owner__isnull=True) | Q(owner_id=task.owner_id))


# listening(task).exists(), written out: asked at every task's end, where compiling the ORM's query cost 0.9 ms of
# CPU and the prepared probe costs 0.1 ms. Most tenants have no endpoint; those that do read them after it.
_ANYONE_LISTENING = (f'SELECT EXISTS (SELECT 1 FROM "{Endpoint._meta.db_table}" WHERE "tenant_id" = %s AND "enabled" '
                     f'AND ("owner_id" IS NULL OR "owner_id" = %s))')


def _anyone_listening(task: Task) -> bool:
    if connection.vendor == "postgresql":
        return prepared.fetchone(_ANYONE_LISTENING, [task.tenant_id, task.owner_id])[0]
    return listening(task).exists()


def enqueue(task: Task, events: Sequence[TaskEvent], endpoints: Sequence[Endpoint]) -> list[Delivery]:
    """pending: one row per endpoint for the newest of these events it wants; older undelivered ones superseded."""
    at = events[-1].at
    fresh = Task.objects.select_related("thread").get(pk=task.pk)  # as this transaction left it
    bodies: dict[int, str] = {}
    rows = []
    for endpoint in endpoints:
        event = next((e for e in reversed(events) if EVENT_TYPES[e.kind] in endpoint.events), None)
        if event is None:
            continue
        event_type = EVENT_TYPES[event.kind]
        if event.seq not in bodies:
            bodies[event.seq] = payloads.body(fresh, event, event_type=event_type)
        rows.append(Delivery(tenant_id=task.tenant_id, endpoint=endpoint, task_id=task.pk, event_seq=event.seq,
                             event_type=event_type, webhook_id=signing.webhook_id(uuid.uuid4()),
                             body=bodies[event.seq], status=D.PENDING, next_attempt_at=at, created_at=at))
    if not rows:
        return []
    # Events of earlier batches have lower seqs: what they left undelivered is replaced by these.
    Delivery.objects.filter(task_id=task.pk, endpoint_id__in=[row.endpoint_id for row in rows],
                            event_seq__lt=events[0].seq, status__in=SUPERSEDABLE).update(
        status=D.SUPERSEDED, next_attempt_at=None)
    created = Delivery.objects.bulk_create(rows)
    for delivery in created:
        kicks.kick(JOB, delivery.pk)
    return created


# --- the deliverer's transitions ------------------------------------------------------


def _due(now: datetime) -> Q:
    return Q(status__in=[D.PENDING, D.RETRY], next_attempt_at__lte=now) | Q(status=D.CLAIMED, lease_expires_at__lt=now)


def _released() -> dict[str, Any]:
    return {"lease_owner": "", "lease_expires_at": None}


def signing_secrets(endpoint: Endpoint, *, now: datetime) -> list[str]:
    """The current secret, and the previous one while its rotation overlap lasts."""
    keys = [endpoint.secret]
    if endpoint.previous_secret and endpoint.previous_secret_expires_at and endpoint.previous_secret_expires_at > now:
        keys.append(endpoint.previous_secret)
    return keys


def claim(delivery_id: int, *, owner: str, now: datetime) -> Claimed | None:
    """pending/retry (due), or claimed by a deliverer whose lease expired -> claimed, leased to `owner`.

    None when nothing is due, another deliverer holds it, or its endpoint is disabled. A row whose
    attempts ran out while claimed (its deliverer keeps dying) is dead-lettered instead.
    """
    lease = now + timedelta(seconds=settings.LONGHAUL_WEBHOOK_LEASE_SECONDS)
    with transaction.atomic():
        row = (  # waits for a row another transaction holds, then reads it again: the kick is its only hint
            Delivery.objects.select_for_update(of=("self",))
            .select_related("endpoint")
            .filter(_due(now), pk=delivery_id, endpoint__enabled=True)
            .first()
        )
        if row is None:
            return None
        if row.attempts >= settings.LONGHAUL_WEBHOOK_MAX_ATTEMPTS:
            rows = Delivery.objects.filter(pk=row.pk, status=row.status, attempts=row.attempts)
            _dead_letter(rows, row.pk, f"{row.attempts} attempts ended without an answer (the deliverer stopped)",
                         now=now)
            return None
        attempt = row.attempts + 1
        won = Delivery.objects.filter(pk=row.pk, status=row.status, attempts=row.attempts).update(
            status=D.CLAIMED, attempts=attempt, lease_owner=owner, lease_expires_at=lease, next_attempt_at=None)
        if not won:
            return None
        # Should this deliverer die, the row is looked at again when its lease expires, not at the next sweep.
        watchdog = kicks.kick(JOB, row.pk, at=lease + WATCHDOG_MARGIN)
        return Claimed(delivery_id=row.pk, endpoint_id=row.endpoint_id, task_id=row.task_id, event_seq=row.event_seq,
                       attempt=attempt, webhook_id=row.webhook_id, url=row.endpoint.url,
                       body=row.body, signing_secrets=signing_secrets(row.endpoint, now=now), watchdog_kick=watchdog)


def _held(claimed: Claimed, owner: str) -> QuerySet[Delivery]:
    """The row as this deliverer claimed it: nobody has claimed it since (owner and attempt both checked)."""
    return Delivery.objects.filter(pk=claimed.delivery_id, status=D.CLAIMED, lease_owner=owner,
                                   attempts=claimed.attempt)


def delivered(claimed: Claimed, owner: str, *, status_code: int, now: datetime) -> bool:
    """claimed -> delivered: the receiver answered 2xx."""
    with transaction.atomic():
        won = bool(_held(claimed, owner).update(status=D.DELIVERED, delivered_at=now, last_status_code=status_code,
                                                last_error="", **_released()))
        if won:
            kicks.withdraw(claimed.watchdog_kick)
    return won


def fail(claimed: Claimed, owner: str, error: str, *, status_code: int | None, permanent: bool,
         now: datetime) -> str:
    """claimed -> retry with capped backoff, or dead_letter on the last attempt (or at once when permanent);
    superseded instead when a newer event of its task for its endpoint arrived while it was in flight."""
    rows = _held(claimed, owner)
    with transaction.atomic():
        if Delivery.objects.filter(endpoint_id=claimed.endpoint_id, task_id=claimed.task_id,
                                   event_seq__gt=claimed.event_seq).exists():
            won = bool(rows.update(status=D.SUPERSEDED, next_attempt_at=None, last_error=error[:2000],
                                   last_status_code=status_code, **_released()))
            outcome = "superseded"
        elif permanent or claimed.attempt >= settings.LONGHAUL_WEBHOOK_MAX_ATTEMPTS:
            why = error if permanent else f"{claimed.attempt} attempts failed, the last: {error}"
            won = _dead_letter(rows, claimed.delivery_id, why, now=now, status_code=status_code)
            outcome = "dead_letter"
        else:
            run_at = now + retry_delay(claimed.attempt)
            won = bool(rows.update(status=D.RETRY, next_attempt_at=run_at, last_error=error[:2000],
                                   last_status_code=status_code, **_released()))
            if won:
                kicks.kick(JOB, claimed.delivery_id, at=run_at)
            outcome = "retry"
        if not won:
            return "lost"
        kicks.withdraw(claimed.watchdog_kick)
    return outcome


def _dead_letter(rows: QuerySet[Delivery], delivery_id: int, why: str, *, now: datetime,
                 status_code: int | None = None) -> bool:
    changed = rows.update(status=D.DEAD_LETTER, next_attempt_at=None, last_error=why[:2000],
                          last_status_code=status_code, **_released())
    if changed:
        delivery = Delivery.objects.select_related("task", "endpoint").get(pk=delivery_id)
        raise_alert(Alert.Kind.DEAD_LETTER, f"webhook {delivery.event_type} for task {delivery.task.name!r} to "
                    f"{delivery.endpoint.url} dead-lettered: {why[:200]}", now=now, task=delivery.task)
    return bool(changed)


def retry_delay(failures: int) -> timedelta:
    """base, 2 x base, 4 x base ... after the 1st, 2nd, 3rd failure, capped, with up to 10% jitter so failed receivers are not hit in step."""
    base = settings.LONGHAUL_WEBHOOK_RETRY_BASE_SECONDS
    delay = min(base * 2 ** min(failures - 1, 16), settings.LONGHAUL_WEBHOOK_RETRY_CAP_SECONDS)
    return timedelta(seconds=delay * (1 + random.random() / 10))


# --- operators and the sweeper -----------------------------------------------------------


def retry_dead_letter(delivery: Delivery, *, now: datetime) -> bool:
    """dead_letter -> pending: an operator's retry, a fresh set of attempts (the same webhook-id)."""
    with transaction.atomic():
        won = bool(Delivery.objects.filter(pk=delivery.pk, status=D.DEAD_LETTER).update(
            status=D.PENDING, attempts=0, next_attempt_at=now, **_released()))
        if won:
            kicks.kick(JOB, delivery.pk)
    return won


def kick_due(now: datetime, *, limit: int) -> int:
    """For the sweep: rows whose kick was lost, or whose deliverer died (lease expired)."""
    ids = list(
        Delivery.objects.filter(endpoint__enabled=True)
        .filter(Q(status__in=[D.PENDING, D.RETRY], next_attempt_at__lte=now - KICK_GRACE)
                | Q(status=D.CLAIMED, lease_expires_at__lt=now))
        .values_list("pk", flat=True)[:limit]
    )
    for delivery_id in ids:
        kicks.kick(JOB, delivery_id)
    return len(ids)


def kick_waiting(endpoint: Endpoint) -> int:
    """An endpoint was enabled again: its waiting rows may go now."""
    ids = list(Delivery.objects.filter(endpoint=endpoint, status__in=[D.PENDING, D.RETRY]).values_list("pk", flat=True))
    for delivery_id in ids:
        kicks.kick(JOB, delivery_id)
    return len(ids)


def rotate_secret(endpoint: Endpoint, *, now: datetime) -> str | None:
    """A new signing secret; the old one keeps signing (a second signature) through the overlap.

    Guarded by the secret the caller read: of two rotations at once, one wins. None when it lost.
    """
    secret = signing.new_secret()
    won = Endpoint.objects.filter(pk=endpoint.pk, secret=endpoint.secret).update(
        secret=secret, previous_secret=endpoint.secret, secret_rotated_at=now,
        previous_secret_expires_at=now + timedelta(seconds=settings.LONGHAUL_WEBHOOK_SECRET_OVERLAP_SECONDS))
    return secret if won else None
