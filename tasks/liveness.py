"""The liveness rules (DESIGN §4 "Nothing is ever stranded"), checked and repaired.

For every row that is not finished there is always a way forward. At every commit one
of these holds for a task that is not terminal:

- a lease that has not expired (someone is working on it);
- a due time (`next_run_at`) that the sweeper's kick reaches even if every other kick is lost;
- an unfinished operation whose completion makes the task due;
- a wait for a person (`waiting_input`, `paused`, `partial`), visible to them (a waiting_input
  task may watch its remote task meanwhile: a watch call makes nothing due, and is closed when
  the task stops waiting for the answer);
- queued behind a full quota (a slot-holding task's end admits it).

The same for the notification outbox (due, leased, or dispatched to a run that is still
going) and operations (pending or leased while their task waits, or closed when it ends).
`find_violations` lists the rows that break a rule (writing only the slice cursors), with indexed queries
bounded by the sweep batch; `repair` fixes each and raises an alert naming the row and
the rule (nothing is repaired silently); /metrics counts repairs by rule.

The rules whose candidates are every task waiting on a call, or every call not finished (ten
thousand of each while as many remote jobs run for hours), look at a rotating slice each pass
(LONGHAUL_LIVENESS_SLICE, by id, on from where the last pass stopped: SweepCursor), so a pass
costs the same at a thousand and at ten thousand: such a row is found within ceil(rows / slice)
passes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.db import connection, transaction
from django.db.models import BooleanField, Case, Exists, F, OuterRef, Q, QuerySet, Value, When

from tasks import kicks, notifications, operations, scheduling, transitions
from tasks.alerts import raise_alert
from tasks.models import Alert, Operation, SweepCursor, Task
from tasks.statuses import CLAIMABLE, HOLDS_SLOT, TERMINAL, NotificationStatus, OperationStatus, TaskStatus

log = logging.getLogger(__name__)
S = TaskStatus
N = NotificationStatus
UNFINISHED_OPS = (OperationStatus.PENDING, OperationStatus.STARTED)


@dataclass(frozen=True)
class Violation:
    """A row with no way forward, and the rule it breaks."""

    rule: str
    table: str  # "task" | "operation" | "notification" | "run"
    row_id: int
    detail: str


# --- the rules ---------------------------------------------------------------------


def sliced(rows: QuerySet, rule: str, find: Callable[[QuerySet], QuerySet], *, limit: int) -> list:
    """`find` over this pass's slice of `rows`, by id, at most `limit`: the next LONGHAUL_LIVENESS_SLICE rows
    after where `rule`'s last pass stopped, or all those left (the next pass then starts again from the
    first). The slice is a range of ids read off the index `rows` use. The rule's cursor (SweepCursor) moves
    past the slice, or only past the last row found when `limit` cut the list short."""
    size = settings.LONGHAUL_LIVENESS_SLICE
    after = SweepCursor.objects.filter(rule=rule).values_list("after_id", flat=True).first() or 0
    upto = rows.filter(pk__gt=after).order_by("pk").values_list("pk", flat=True)[size - 1:size].first()
    window = rows.filter(pk__gt=after) if upto is None else rows.filter(pk__gt=after, pk__lte=upto)
    with _row_by_row():
        found = list(find(window).order_by("pk")[:limit])
    moved_to = found[-1].pk if len(found) == limit else (upto or 0)
    if not SweepCursor.objects.filter(rule=rule).update(after_id=moved_to):
        SweepCursor.objects.get_or_create(rule=rule, defaults={"after_id": moved_to})
    return found


@contextmanager
def _row_by_row() -> Iterator[None]:
    """PostgreSQL: join a slice's rows to the other table (a task's calls, a call's task) one row at a time,
    by index. Once that table outgrows the slice, the planner would rather hash all of it (ten thousand
    unfinished calls, or every task), and a pass would grow with the table again."""
    if connection.vendor != "postgresql":
        yield
        return
    # Local to the transaction (true), and put back as they were at once, in case the caller's transaction goes
    # on. On an error the block's rollback puts them back.
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SELECT current_setting('enable_hashjoin'), current_setting('enable_mergejoin')")
        before = cursor.fetchone()
        cursor.execute("SELECT set_config('enable_hashjoin', 'off', true), set_config('enable_mergejoin', 'off', true)")
        yield
        cursor.execute("SELECT set_config('enable_hashjoin', %s, true), set_config('enable_mergejoin', %s, true)",
                       before)


def _unfinished_ops_of_last_step() -> Exists:
    # Not a watch call (task:step:w<n>): it runs while the owner is asked, and makes nothing due.
    return Exists(Operation.objects.filter(task=OuterRef("pk"), step=OuterRef("current_step") - 1,
                                           status__in=UNFINISHED_OPS)
                  .exclude(key__contains=f":{operations.WATCH_PREFIX}"))


def waits_for_nothing(limit: int) -> list[Task]:
    """Waiting for operations (waiting_tool, or running for the model) that have all finished:
    their last completion did not make the task due (rule `operations_done_unnoticed`)."""
    waiting = Q(status=S.WAITING_TOOL) | Q(status=S.RUNNING, waiting_reason__in=("model", "tool"))
    candidates = Task.objects.filter(waiting, lease_owner="", next_run_at__isnull=True)  # task_waiting_calls_idx
    return sliced(candidates, "operations_done_unnoticed", lambda rows: rows.exclude(_unfinished_ops_of_last_step()),
                   limit=limit)


def never_due(limit: int) -> list[Task]:
    """Claimable, not held, not waiting for calls, and with no due time: nothing would ever claim it
    (rule `task_not_due`)."""
    return list(Task.objects.filter(status__in=CLAIMABLE, next_run_at__isnull=True)
                .filter(Q(lease_owner="") | Q(lease_expires_at__isnull=True))
                .exclude(status=S.RUNNING, waiting_reason__in=("model", "tool"))[:limit])


def stop_not_acted_on(now: datetime, limit: int) -> list[Task]:
    """Asked to cancel (or pause) while nobody holds it and nothing will claim it: the request
    should have stopped it at once (rule `stop_request_ignored`)."""
    grace = now - timedelta(seconds=settings.LONGHAUL_LEASE_SECONDS)
    stoppable = [S.QUEUED, S.RUNNING, S.RETRY_WAIT, S.WAITING_INPUT, S.WAITING_TOOL]
    # A paused task asked to cancel is stoppable too; a partial one is a person's to resume or cancel, and
    # keeps the request that made it partial.
    asked = Q(cancel_requested_at__lt=grace, status__in=[*stoppable, S.PAUSED]) \
        | Q(pause_requested_at__lt=grace, status__in=stoppable)
    unheld = Q(lease_owner="") | Q(lease_expires_at__lt=now)
    # Still waiting on calls (a remote cancel round, say): their completion makes it due, and it stops then.
    # Queued to cancel its remote work: it waits for a slot, which rule `admission_missed` watches.
    return list(Task.objects.filter(asked, unheld)
                .filter(Q(next_run_at__isnull=True) | ~Q(status__in=CLAIMABLE))
                .exclude(status=S.QUEUED, waiting_reason=transitions.CANCEL_WAIT)
                .exclude(_unfinished_ops_of_last_step())[:limit])


def queued_with_free_slots() -> list[int]:
    """Tenants whose queued tasks could take a free slot now (rule `admission_missed`)."""
    free = settings.LONGHAUL_MAX_RUNNING - Task.objects.filter(status__in=sorted(HOLDS_SLOT)).count()
    if free <= 0:
        return []
    return [q.tenant_id for q in scheduling.waiting_tenants()]


def orphaned_operations(now: datetime, limit: int) -> list[Operation]:
    """Unfinished operations of a task that has ended, or watch calls of a task no longer waiting for
    its owner's answer to the step that asked, that no gateway job holds: nothing will ever run or
    close them (rule `operation_orphaned`)."""
    grace = now - timedelta(seconds=settings.LONGHAUL_OPERATION_LEASE_SECONDS)
    # Not the remote cancel a task's end asks for (an abandon): gateway jobs run it whatever the task's status.
    ended = Q(task__status__in=sorted(TERMINAL)) & ~Q(key__contains=":a")  # task:step:a<n> (request_abandon)
    # A watch call (task:step:w<n>) runs only while its task waits for the answer to the step that asked.
    unwatched = Q(key__contains=f":{operations.WATCH_PREFIX}") & ~Q(task__status__in=sorted(TERMINAL)) & ~(
        Q(task__status=S.WAITING_INPUT) & Q(step=F("task__current_step") - 1))
    # As a CASE, not a bare OR: an OR whose arms test both the call and its task costs PostgreSQL's planner
    # about 6 ms a pass trying index paths for each arm (as operations._claimable says).
    orphaned = Case(When(ended | unwatched, then=Value(True)), default=Value(False), output_field=BooleanField())
    candidates = Operation.objects.filter(status__in=UNFINISHED_OPS)  # operation_unfinished_idx
    return sliced(candidates, "operation_orphaned", lambda rows: (
        rows.filter(orphaned)
        .filter(Q(status=OperationStatus.PENDING, created_at__lt=grace)
                | Q(status=OperationStatus.STARTED, lease_expires_at__lt=now))
        .select_related("task")), limit=limit)


def notifications_not_due(limit: int) -> list[Task]:
    """Pending or retrying with no due time (rule `notification_not_due`)."""
    return list(Task.objects.filter(notification_status__in=[N.PENDING, N.RETRY],
                                    next_notification_at__isnull=True)[:limit])


def notifications_untold(limit: int) -> list[Task]:
    """A newer event than the one told, on a row the deliverer will not look at (rule `notification_untold`)."""
    return list(Task.objects.filter(notification_status__in=[N.NONE, N.DELIVERED], thread__isnull=False,
                                    event_version__gt=0)
                .filter(event_version__gt=F("notified_version"))[:limit])


def dispatched_runs_ended(now: datetime, limit: int) -> list[tuple[Task, str]]:
    """Dispatched notifications whose run has ended or vanished without telling the outbox
    (rule `notification_run_lost`); runs still going are only watched again."""
    found = []
    for task in Task.objects.filter(notification_status=N.DISPATCHED, next_notification_at__lte=now)[:limit]:
        state = notifications.dispatched_run_state(task)
        if state != "active":
            found.append((task, state))
    return found


def find_violations(now: datetime) -> list[Violation]:
    """Every row that breaks a liveness rule now (it writes nothing but the slice cursors)."""
    limit = settings.LONGHAUL_SWEEP_BATCH
    out: list[Violation] = []
    out += [Violation("operations_done_unnoticed", "task", t.pk, f"{t.status}, its calls all finished")
            for t in waits_for_nothing(limit)]
    out += [Violation("task_not_due", "task", t.pk, f"{t.status} with no due time and no lease")
            for t in never_due(limit)]
    out += [Violation("stop_request_ignored", "task", t.pk, f"{t.status}, asked to stop")
            for t in stop_not_acted_on(now, limit)]
    out += [Violation("admission_missed", "task", tenant_id, "a tenant's queued task could take a free slot")
            for tenant_id in queued_with_free_slots()]
    out += [Violation("operation_orphaned", "operation", op.pk, f"{op.status} after its task {op.task.status}")
            for op in orphaned_operations(now, limit)]
    out += [Violation("notification_not_due", "notification", t.pk, f"{t.notification_status} with no due time")
            for t in notifications_not_due(limit)]
    out += [Violation("notification_untold", "notification", t.pk,
                      f"v{t.event_version} newer than v{t.notified_version}, {t.notification_status}")
            for t in notifications_untold(limit)]
    out += [Violation("notification_run_lost", "notification", t.pk, f"dispatched; its run is {state}")
            for t, state in dispatched_runs_ended(now, limit)]
    return out


# --- repairs -------------------------------------------------------------------------


def repair(now: datetime) -> dict[str, int]:
    """Fix every violation found, each in its own transaction, with an alert naming the row and the rule."""
    limit = settings.LONGHAUL_SWEEP_BATCH
    repairs: dict[str, Callable[[], Iterator[tuple[Task | None, str]]]] = {
        "operations_done_unnoticed": lambda: _make_due(waits_for_nothing(limit), now, "its calls had all finished"),
        "task_not_due": lambda: _make_due(never_due(limit), now, "it had no due time and no lease"),
        "stop_request_ignored": lambda: _stop(stop_not_acted_on(now, limit), now),
        "admission_missed": lambda: _admit(now),
        "operation_orphaned": lambda: _close_operations(orphaned_operations(now, limit), now),
        "notification_not_due": lambda: _notification_due(notifications_not_due(limit), now),
        "notification_untold": lambda: _notification_due(notifications_untold(limit), now),
        "notification_run_lost": lambda: _settle_dispatched(now, limit),
    }
    counts: dict[str, int] = {}
    for rule, fix in repairs.items():
        counts[rule] = 0
        try:
            for task, what in fix():
                _alert(rule, task, what, now=now)
                counts[rule] += 1
        except Exception:  # one broken rule must not stop the others
            log.exception("liveness repair %s failed", rule)
    return counts


def _alert(rule: str, task: Task | None, what: str, *, now: datetime) -> None:
    name = f"task {task.name!r}" if task else "a row"
    with transaction.atomic():
        alert = raise_alert(Alert.Kind.LIVENESS, f"{name}: {what}; repaired (rule {rule})", now=now, task=task)
        Alert.objects.filter(pk=alert.pk).update(rule=rule)


def _make_due(tasks: list[Task], now: datetime, why: str) -> Iterator[tuple[Task, str]]:
    for task in tasks:
        with transaction.atomic():
            won = transitions.make_due(task, now=now, reason=why)
            if won:
                kicks.kick("advance", task.pk)
        if won:
            yield task, f"{why}; made due now"


def _stop(tasks: list[Task], now: datetime) -> Iterator[tuple[Task, str]]:
    from tasks.stopping import stop_as_requested

    for task in tasks:
        with transaction.atomic():
            fresh = Task.objects.select_for_update().get(pk=task.pk)
            if fresh.status in TERMINAL:
                continue
            stop_as_requested(fresh, now=now)
        yield fresh, "a stop request was not acted on; stopped now"


def _admit(now: datetime) -> Iterator[tuple[Task | None, str]]:
    if not queued_with_free_slots():
        return
    with transaction.atomic():
        admitted = scheduling.admit(now=now, take_back=False)  # what waited beside a free slot, no more
    for task in Task.objects.filter(pk__in=admitted):
        yield task, "it waited in the queue while a slot was free; admitted"


def _close_operations(ops: list[Operation], now: datetime) -> Iterator[tuple[Task, str]]:
    for op in ops:
        closed = Operation.objects.filter(pk=op.pk, status=op.status).update(
            status=OperationStatus.FAILED, error_class="cancelled", error_message="its task ended before it finished",
            finished_at=now, lease_owner="", lease_expires_at=None)
        if closed:
            yield op.task, f"operation {op.key} ({op.kind} {op.name}) outlived its task; closed"


def _notification_due(tasks: list[Task], now: datetime) -> Iterator[tuple[Task, str]]:
    for task in tasks:
        if Task.objects.filter(pk=task.pk, notification_status=task.notification_status,
                               event_version=task.event_version).update(
                notification_status=N.PENDING, next_notification_at=now):
            kicks.kick("deliver", task.pk)
            yield task, f"notification v{task.event_version} was {task.notification_status} with nothing due; pending"


def _settle_dispatched(now: datetime, limit: int) -> Iterator[tuple[Task, str]]:
    for task in Task.objects.filter(notification_status=N.DISPATCHED, next_notification_at__lte=now)[:limit]:
        state = notifications.dispatched_run_state(task)
        with transaction.atomic():
            if state == "active":
                notifications.watch_again(task, now=now)  # a long run: not a violation
                continue
            if state == "succeeded":
                notifications.run_finished(task.pk, task.dispatch_version, now=now)
            else:
                notifications.run_failed(task.pk, task.dispatch_version, now=now,
                                         error=f"the notification run is {state} and never reported back")
        yield task, f"notification v{task.dispatch_version} was dispatched to a run that is {state}; settled"
