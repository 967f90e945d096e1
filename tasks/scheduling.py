"""Admission: which queued task gets a running slot, and when submissions are refused.

Quotas: a tenant holds at most `max_running` slots and keeps at most `max_queued`
tasks waiting; the system caps both too (LONGHAUL_MAX_RUNNING, LONGHAUL_MAX_QUEUED).

Admission is event driven: every transition that frees a slot (a task ends, pauses,
waits for input) or queues a task calls `admit` in the same transaction (in
tasks/transitions.py, one place), which fills every free slot in the system and kicks
the tasks it admitted. The sweeper's liveness check admits too, with an alert, only
if that ever failed.

The next task is chosen in this order (DESIGN §5):

1. Tenant share: the tenant holding the fewest slots per unit of `Tenant.weight`
   (running / weight, counted over slot-holding tasks, not submissions) goes first.
   A tenant with a thousand queued tasks therefore gets no more slots than one
   with three beyond what their weights say. Weight 0 means "leftovers only".
2. Effective priority of that tenant's head of queue, with aging:
   `priority + floor(seconds waited / LONGHAUL_AGING_SECONDS)` (default 60 s), so
   every minute of waiting is worth one priority point. With priorities in
   [-10, 10], a task waits at most about (10 - its priority) * aging seconds behind
   higher-priority tasks that arrive after it. Waiting is measured from
   `created_at` (the column task_queued_idx orders by).
3. Waiting time: the older task, then the lower id.

Within a tenant, a task queued only to cancel its remote work (its owner cancelled it
while it held no slot) goes before all of these: telling the server to stop takes a
slot, and the cancel is what frees the remote work the task holds.

These rules are tasks/admission_policy.py, code without the database that this module feeds with
heads of queue read from it, and that the replay (tasks/replay.py) feeds with recorded arrivals.
Each decision is also written to the admission records (tasks/admission_records.py).
"""

from __future__ import annotations

import itertools
import logging
import threading
import zlib
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.db import DatabaseError, connection, transaction
from django.db.models import BooleanField, Case, Count, Exists, F, OuterRef, QuerySet, Subquery, When
from django.db.models.expressions import RawSQL
from django.db.models.functions import Coalesce

from tasks import admission_policy as policy
from tasks import admission_records, clock, kicks, prepared, transitions
from tasks.alerts import raise_alert
from tasks.budgets import Budget
from tasks.compiled import compiled_once
from tasks.errors import QuotaExceeded
from tasks.models import Alert, AuditEntry, Task, Tenant
from tasks.statuses import HOLDS_SLOT, TaskStatus

QUEUE_FULL_RETRY_AFTER = 30  # seconds a refused client is asked to wait
REJECTED = "task.rejected"  # AuditEntry.action of a refused submission; /metrics counts them
REJECTION_ALERT_EVERY = timedelta(hours=1)
_ADMISSION_LOCK = zlib.crc32(b"longhaul-admission")
_SLOT_STATUSES = sorted(HOLDS_SLOT)
log = logging.getLogger(__name__)


# --- backpressure -----------------------------------------------------------------


def check_queue_capacity(tenant: Tenant, *, priority: int) -> None:
    """Refuse a submission up front (429) rather than time it out later.

    Past LONGHAUL_SHED_THRESHOLD of the tenant's max_queued, a submission whose priority is
    below the median of the tenant's queue is refused too (rule "shed_low_priority"), so the
    places left go to its higher priorities; at the cap, everything is refused. Shedding looks
    at the tenant's own queue only: the system's would let one tenant's priorities refuse
    another's work, and its figures would tell one tenant of the others' load.
    A soft cap: two submissions racing for the last place may both get it. Tasks queued only to
    cancel their remote work count in no queue.
    """
    refused = policy.refusal(
        tenant_policy(tenant), system_policy(), priority=priority, queued=_queued_to_run(tenant.pk),
        median=lambda: median_priority(_queue_to_run().filter(tenant=tenant)),
        system_queued=lambda: _queued_to_run(None))
    if refused is None:
        return
    queued = refused.queued
    if refused.rule == "tenant_queue_full":
        message = f"tenant {tenant.slug} already has {queued} queued tasks (limit {tenant.max_queued})"
    elif refused.rule == "shed_low_priority":
        message = (f"tenant {tenant.slug}'s queue is {100 * queued // tenant.max_queued}% full ({queued} of "
                   f"{tenant.max_queued}): only priority {refused.median} or higher is accepted until it drains "
                   f"(this task's priority is {priority})")
    else:
        message = "the system queue is full"
    raise QuotaExceeded(message, retry_after=QUEUE_FULL_RETRY_AFTER, rule=refused.rule)


def _queue_to_run() -> QuerySet[Task]:
    """The tasks queued to run: not those queued only to cancel their remote work."""
    return Task.objects.filter(status=TaskStatus.QUEUED).exclude(waiting_reason=transitions.CANCEL_WAIT)


# The tasks queued to run, of a tenant and of the system: asked at every submission, so written out and prepared.
_QUEUED_TO_RUN = (f'SELECT count(*) FROM "{Task._meta.db_table}" WHERE "status" = \'{TaskStatus.QUEUED.value}\' '
                  f"AND NOT \"waiting_reason\" = '{transitions.CANCEL_WAIT}'")
_QUEUED_TO_RUN_OF = f'{_QUEUED_TO_RUN} AND "tenant_id" = %s'


def _queued_to_run(tenant_id: int | None) -> int:
    """How many tasks are queued to run: the tenant's, or the whole system's (None)."""
    if connection.vendor == "postgresql":
        if tenant_id is None:
            return prepared.fetchone(_QUEUED_TO_RUN, [])[0]
        return prepared.fetchone(_QUEUED_TO_RUN_OF, [tenant_id])[0]
    queue = _queue_to_run()
    return (queue if tenant_id is None else queue.filter(tenant_id=tenant_id)).count()


def median_priority(queue: QuerySet[Task]) -> int | None:
    """The median priority of queued tasks (the lower middle of an even count), from one count per
    priority level (at most 21) instead of the tasks themselves."""
    return policy.median_of_levels(queue.order_by("priority").values_list("priority").annotate(n=Count("*")))


system_policy = policy.system_policy


def tenant_policy(tenant: Tenant) -> policy.TenantPolicy:
    return policy.TenantPolicy(weight=tenant.weight, max_running=tenant.max_running, max_queued=tenant.max_queued)


def record_rejection(tenant: Tenant, *, user_id: int | None, reason: str, rule: str, now: datetime,
                     priority: int = 0, kind: str = "", max_wall_seconds: int | None = None) -> None:
    """Count a refused submission, keep it for the replay, and alert operators, at most once per tenant
    per hour. `priority`, `kind` and `max_wall_seconds` describe the refused submission (the defaults'
    where a caller does not know them).

    Call it after the refused submission's transaction rolled back, or it is rolled back too.
    """
    with transaction.atomic():
        wall = Budget.of({}).max_wall_seconds if max_wall_seconds is None else max_wall_seconds
        admission_records.refused(tenant, priority=priority, kind=kind, max_wall_seconds=wall,
                                  rule=rule, tenant_policy=tenant_policy(tenant), system=system_policy(), now=now)
        AuditEntry.objects.create(tenant=tenant, actor_id=user_id, action=REJECTED, target_type="tenant",
                                  target_id=tenant.slug, details={"reason": reason[:500], "rule": rule}, at=now)
        if _rejection_alert_raised(tenant.pk, now=now):
            return
        # Double-checked under the tenant row lock, so concurrent refusals raise one alert.
        Tenant.objects.select_for_update().filter(pk=tenant.pk).first()
        if _rejection_alert_raised(tenant.pk, now=now):
            return
        raise_alert(Alert.Kind.QUOTA_REJECTIONS,
                    f"tenant {tenant.slug}: submissions are being refused with 429 ({reason[:300]}); "
                    f"further refusals this hour are counted in /metrics, not alerted",
                    now=now, tenant_id=tenant.pk)


def _rejection_alert_raised(tenant_id: int, *, now: datetime) -> bool:
    return Alert.objects.filter(kind=Alert.Kind.QUOTA_REJECTIONS, tenant_id=tenant_id,
                                created_at__gt=now - REJECTION_ALERT_EVERY).exists()


# --- admission --------------------------------------------------------------------


def aging_seconds() -> float:
    """Seconds of waiting worth one priority point."""
    return system_policy().aging_seconds


def effective_priority(priority: int, created_at: datetime, *, now: datetime) -> int:
    """Priority plus one point per aging period waited: nothing waits forever behind higher priority."""
    return policy.effective_priority(priority, created_at, now=now, aging_seconds=aging_seconds())


# Whether a tenant has one task queued, no more: two probes of task_queued_idx at most. Such a tenant is served by one
# read of its queue, not a second that finds it empty (a submission to a tenant with a free slot made both).
_QUEUED_ONE = RawSQL(
    f"""(SELECT count(*) = 1 FROM (SELECT 1 FROM "{Task._meta.db_table}" q WHERE q.tenant_id = "{Tenant._meta.db_table}"."id"
         AND q.status = '{TaskStatus.QUEUED.value}' LIMIT 2) AS up_to_two)""", [],
    output_field=BooleanField())


@dataclass
class TenantQueue:
    """A tenant that has queued tasks and a free slot of its own, as admission sees it: a
    policy.WaitingQueue whose head is read from the database, locked, when the chooser first asks."""

    tenant_id: int
    weight: int
    max_running: int
    max_queued: int
    running: int
    queued_one: bool = False  # the tenant had one task queued, no more, when admission read it
    cancelling: bool = True  # whether one of them may be queued only to cancel its remote work (if so, looked for)
    task: Task | None = None
    fetched: bool = False

    def head(self, *, now: datetime, aging_seconds: float) -> policy.Head | None:
        if not self.fetched:
            self.task = head_of_queue(self.tenant_id, now=now, aging=aging_seconds, cancelling=self.cancelling)
            self.fetched = True
        return None if self.task is None else _head(self.task)

    def take(self) -> Task:
        """The head, which the next read of `head` no longer returns. A queue that held one task is known empty
        then, without reading it again: under the admission lock nobody else queues a task meanwhile (whoever
        does admits after this admission commits)."""
        task, self.task = self.task, None
        assert task is not None
        self.fetched, self.queued_one = self.queued_one, False
        return task


class _Admitting(threading.local):
    """Per thread (a connection's): whether an admission runs further up this stack, and whether a slot was
    freed under it (a slot it took back: transitions.yield_slot admits, as every transition that frees one)."""

    def __init__(self) -> None:
        self.running = False
        self.again = False


_admitting = _Admitting()
START_LOCK_TIMEOUT_S = 5.0  # admit_at_start's longest wait for a lock


def admit(*, now: datetime, take_back: bool = True) -> list[int]:
    """Fill free running slots system-wide, fairly; kick each admitted task. Returns their ids.

    Called by tasks/transitions.py inside the transaction of every transition that frees
    a slot or queues a task (any tenant may get the slot), by a quota change, and by the
    sweeper's liveness check. The choice is policy.fill_slots, which the replay runs too.
    `take_back=False`: fill the free slots only (the liveness check's repair, which names what it admits as
    tasks that waited beside a free slot); the next admission takes back what is owed.

    A slot taken back from a task between steps is freed by a transition, which calls this again,
    inside it: that call only marks the slot, and the admission running here fills it in a further
    pass. Nested instead, one admission owed hundreds of slots (a weight lowered) went six frames
    deeper a slot until RecursionError.
    """
    assert connection.in_atomic_block, "admission commits with the change that freed the slot"
    if _admitting.running:
        _admitting.again = True
        return []
    _admitting.running = True
    try:
        admitted: list[int] = []
        allowed: int | None = None  # read once a pass has taken a slot back, not at every admission
        for passes in itertools.count(1):
            _admitting.again = False
            admitted += _admit_once(now=now, take_back=take_back)
            if not _admitting.again:
                break
            # The bound keeps a policy that would not settle from holding the admission lock forever: the next
            # admission (any transition that frees or queues) carries on.
            allowed = allowed or _passes_allowed()
            if passes >= allowed:
                log.error("admission stopped after %d passes with slots still being taken back", passes)
                break
        return admitted
    finally:
        _admitting.running = _admitting.again = False


def admit_at_start() -> list[int]:
    """A worker cluster's start: admit into the slots a raised LONGHAUL_MAX_RUNNING made free. The cap is read at
    start, and no transition frees a slot for it: the queued tasks waited for the next task to end, or on an idle
    system for the sweeper's admission repair, which takes them for a missed admission and raises an alert.
    A database away at start, or an admission lock it cannot have within START_LOCK_TIMEOUT_S (a session stuck
    holding it), is logged and left to that repair: waited for without end, it kept the cluster from starting, and
    with it the sweeper that repairs."""
    try:
        with transaction.atomic():
            if connection.vendor == "postgresql":
                with connection.cursor() as cursor:
                    cursor.execute(f"SET LOCAL lock_timeout = '{round(START_LOCK_TIMEOUT_S * 1000)}ms'")
            return admit(now=clock.now())
    except DatabaseError as exc:
        log.warning("admission at start failed (%s): the sweeper's next pass admits", exc)
        return []


def _passes_allowed() -> int:
    """The passes one admission may make, asked after a first pass that took a slot back. Each pass after the first
    follows a slot taken back. While the tasks hold no more slots than the cap, a policy that converges takes back
    fewer than the cap (tests/unit/test_take_back_policy.py); above a cap lowered under them, each slot taken back
    brings them one nearer to it and none is filled before: so at most max(cap, slots held) + 1 passes. Bounded by
    the cap alone, an admission above a lowered cap stopped before the newcomer it took the slots back for got one."""
    held_before = _slots_held() + 1  # with the slot the first pass took
    return max(system_policy().max_running, held_before) + 1


def _admit_once(*, now: datetime, take_back: bool) -> list[int]:
    """One pass of admit: fill the free slots, then take one back if a tenant is owed it."""
    _serialize_admission()
    # Stamped now, holding the lock: the caller read `now` before it queued for it, perhaps before the commit
    # that freed the slot it is about to fill. Its admission must not look older than that slot's end.
    now = max(now, clock.now())
    if not _anyone_queued():
        return []  # nobody waits (one probe of task_queued_idx): no slot to fill, none to take back
    system = system_policy()
    take_back = take_back and settings.LONGHAUL_TAKE_SLOTS_BACK
    free = system.max_running - _slots_held()
    if free <= 0 and not take_back:
        return []  # nothing to fill, nothing to take back: no need to read who waits
    queues = waiting_tenants()
    admitted: list[int] = []

    def take(queue: TenantQueue) -> bool:
        task = queue.take()
        if not transitions.admit(task, now=now):
            return False  # cannot happen under our row lock; if it does, the tenant waits for the next admission
        admission_records.admitted(task, tenant=policy.TenantPolicy(queue.weight, queue.max_running,
                                                                    queue.max_queued),
                                   system=system, now=now)
        kicks.kick("advance", task.pk)
        admitted.append(task.pk)
        return True

    policy.fill_slots(queues, free=free, now=now, aging_seconds=system.aging_seconds, take=take)
    # Tenants still waiting means every slot is taken (fill_slots drops the queues it finds empty).
    if queues and take_back:
        take_a_slot_back(queues, now=now, aging_seconds=system.aging_seconds)
    return admitted


def take_a_slot_back(queues: list[TenantQueue], *, now: datetime, aging_seconds: float) -> int | None:
    """Every slot is taken and tenants wait: when the weights say one of them is owed a slot, ask a
    running task of the tenant furthest above its share to give its slot back at its next step
    boundary (transitions.yield_slot, which frees it in its own transaction). Returns that task's id.

    The task is the giver's most recently started one that runs steps here (the least work to set
    aside): not one waiting on calls, asked to stop, or tracking a remote job, whose polls must go on.
    One between steps that nobody holds is at its boundary now: it yields in this transaction, and the
    slot is filled at once (by admit's next pass). Otherwise one held by a worker is asked, and yields
    when its step ends. One request at a time: until the asked task has yielded, admission asks no
    other, so a burst of submissions takes back one slot per step boundary, not every slot at once; a
    request older than a lease (a long step, a long wait for calls) no longer holds the others back.
    Rows locked by someone else are skipped, not waited for, as in head_of_queue."""
    recent = now - timedelta(seconds=settings.LONGHAUL_LEASE_SECONDS)
    if Task.objects.filter(status__in=_SLOT_STATUSES, yield_requested_at__gt=recent).exists():
        return None
    holders = [policy.Holding(tenant_id=t, weight=w, running=n) for t, w, n in
               Task.objects.filter(status__in=_SLOT_STATUSES).order_by().values_list("tenant", "tenant__weight")
               .annotate(n=Count("*"))]
    found = policy.slot_to_take_back(queues, holders, now=now, aging_seconds=aging_seconds)
    if found is None:
        return None
    for giver in found[1]:
        task = (Task.objects.select_for_update(skip_locked=True)
                .filter(tenant_id=giver.tenant_id, status=TaskStatus.RUNNING, yield_requested_at__isnull=True,
                        cancel_requested_at__isnull=True, pause_requested_at__isnull=True,
                        remote_handle__isnull=True, remote_server="")
                .exclude(waiting_reason__in=("model", "tool"))
                .order_by(Case(When(lease_owner="", then=0), default=1), F("started_at").desc(nulls_last=True),
                          "-id").first())
        if task is None:
            continue
        if not task.lease_owner and transitions.yield_slot(task, token=None, now=now):
            return task.pk
        if transitions.ask_to_yield(task, now=now):
            return task.pk
    return None


# Whether a task is queued, written out: asked at every task's end, compiled by the ORM it cost 0.4 ms of CPU,
# prepared 0.1 ms. The status is written in, as task_queued_idx's condition is.
_ANYONE_QUEUED = f"SELECT EXISTS (SELECT 1 FROM \"{Task._meta.db_table}\" WHERE \"status\" = '{TaskStatus.QUEUED.value}')"


def _anyone_queued() -> bool:
    if connection.vendor == "postgresql":
        return prepared.fetchone(_ANYONE_QUEUED, [])[0]
    return Task.objects.filter(status=TaskStatus.QUEUED).exists()


# The slots held, written out for the same reason: asked at every admission that finds a task queued.
_SLOT_LITERALS = ", ".join(f"'{status}'" for status in _SLOT_STATUSES)  # as task_slot_idx's condition
_SLOTS_HELD = f'SELECT count(*) FROM "{Task._meta.db_table}" WHERE "status" IN ({_SLOT_LITERALS})'


def _slots_held() -> int:
    if connection.vendor == "postgresql":
        return prepared.fetchone(_SLOTS_HELD, [])[0]
    return Task.objects.filter(status__in=_SLOT_STATUSES).count()


def _serialize_admission() -> None:
    """One admitter at a time, until its transaction ends, so no cap is exceeded by a race.

    On PostgreSQL a transaction-scoped advisory lock; on SQLite the IMMEDIATE
    transaction already holds the database's write lock.
    """
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_xact_lock(%s)", [_ADMISSION_LOCK])


def waiting_tenants() -> list[TenantQueue]:
    """Tenants with queued tasks and a free slot of their own, with the slots they hold, whether they have one task
    queued, no more, and whether one is queued to cancel.

    Index probes per tenant into task_queued_idx (queued?), task_slot_idx (held) and task_cancel_queued_idx.
    """
    return [TenantQueue(tenant_id=pk, weight=w, max_running=m, max_queued=q, running=r, queued_one=one,
                        cancelling=cancelling)
            for pk, w, m, q, r, one, cancelling in _waiting_tenant_rows()]


@compiled_once  # asked at every admission that finds a task queued: built by the ORM, it cost more than it ran
def _waiting_tenant_rows() -> QuerySet:
    held = (
        Task.objects.filter(tenant=OuterRef("pk"), status__in=_SLOT_STATUSES)
        .order_by().values("tenant").annotate(n=Count("*")).values("n")
    )
    cancelling = Task.objects.filter(tenant=OuterRef("pk"), status=TaskStatus.QUEUED,
                                     waiting_reason=transitions.CANCEL_WAIT)
    return (
        Tenant.objects.filter(Exists(Task.objects.filter(tenant=OuterRef("pk"), status=TaskStatus.QUEUED)))
        .annotate(running=Coalesce(Subquery(held), 0), queued_one=_QUEUED_ONE, cancelling=Exists(cancelling))
        .filter(running__lt=F("max_running"))
        .order_by("pk")
        .values_list("pk", "weight", "max_running", "max_queued", "running", "queued_one", "cancelling")
    )


def _head(task: Task) -> policy.Head:
    return policy.Head(id=task.pk, priority=task.priority, queued_at=task.created_at,
                       cancelling=task.waiting_reason == transitions.CANCEL_WAIT)


def head_of_queue(tenant_id: int, *, now: datetime, aging: float | None = None, cancelling: bool = True) -> Task | None:
    """The tenant's queued task to cancel, else the one with the highest effective priority,
    locked for admission.

    Aging never reorders tasks of one priority (the older is always ahead), so the
    head is the oldest task of one of the priority levels present. Those are found
    with a loose index scan over task_queued_idx (one probe per level present, at
    most 21 with the API's priority range), without reading the rest of the queue.
    Rows locked by someone else (a cancel in flight) are skipped, not waited for:
    waiting here, under the admission lock, could deadlock with that transaction.
    `cancelling=False`: the caller read, under the admission lock, that none of the tenant's queued tasks is
    queued to cancel (waiting_tenants); whoever queues one admits after this admission.
    """
    first = _cancel_waiting(tenant_id) if cancelling else None
    if first is not None:
        return first
    ids = _level_head_ids(tenant_id)
    if not ids:
        return None
    heads = {t.pk: t for t in Task.objects.select_for_update(skip_locked=True).filter(pk__in=ids,
                                                                                     status=TaskStatus.QUEUED)}
    best = policy.best_head(map(_head, heads.values()), now=now, aging_seconds=aging_seconds() if aging is None else aging)
    return None if best is None else heads[best.id]


def _cancel_waiting(tenant_id: int) -> Task | None:
    """The tenant's oldest task queued only to cancel its remote work (transitions.queue_for_cancel):
    it goes before any priority, since a cancel is the owner's wish to free what the task holds.
    One probe into task_cancel_queued_idx."""
    return (Task.objects.select_for_update(skip_locked=True)
            .filter(tenant_id=tenant_id, status=TaskStatus.QUEUED, waiting_reason=transitions.CANCEL_WAIT)
            .order_by("updated_at", "id").first())


def _level_head_ids(tenant_id: int) -> list[int]:
    """Ids of the oldest queued task at each priority level of the tenant (a recursive CTE)."""
    table = connection.ops.quote_name(Task._meta.db_table)
    # 'queued' is written as a literal so the planner can match task_queued_idx's predicate.
    queued = f"status = '{TaskStatus.QUEUED.value}'"
    sql = f"""
        WITH RECURSIVE levels(priority) AS (
            SELECT MAX(priority) FROM {table} WHERE tenant_id = %s AND {queued}
            UNION ALL
            SELECT (SELECT MAX(q.priority) FROM {table} q
                    WHERE q.tenant_id = %s AND q.{queued} AND q.priority < levels.priority)
            FROM levels WHERE levels.priority IS NOT NULL
        )
        SELECT (SELECT q.id FROM {table} q
                WHERE q.tenant_id = %s AND q.{queued} AND q.priority = levels.priority
                ORDER BY q.created_at, q.id LIMIT 1)
        FROM levels WHERE levels.priority IS NOT NULL
    """
    with connection.cursor() as cursor:
        cursor.execute(sql, [tenant_id, tenant_id, tenant_id])
        return [row[0] for row in cursor.fetchall() if row[0] is not None]
