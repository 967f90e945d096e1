"""What must hold after a drill, each check returning the violations it found (never raising).

Scoped to one tenant, so a long drill can share a database with other work.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass
from datetime import datetime

from django.db.models import Count

from chat.models import Message, Run, Thread
from tasks.models import Operation, SleepEffect, Task, TaskEvent
from tasks.statuses import TERMINAL, ErrorClass, NotificationStatus, OperationStatus, TaskStatus
from tests.drill.stream import StreamWatcher

TERMINAL_EVENTS = {"succeeded", "failed", "cancelled", "partial"}
# Research meets injected model and tool faults; giving up on them is an honest ending.
RESEARCH_MAY_FAIL_WITH = {ErrorClass.PERMANENT, ErrorClass.TIMEOUT, ErrorClass.TRANSIENT, ErrorClass.RATE_LIMITED,
                          ErrorClass.BUDGET_EXHAUSTED}


@dataclass(frozen=True)
class Violation:
    invariant: str
    detail: str

    def __str__(self) -> str:
        return f"{self.invariant}: {self.detail}"


def check_all(tenant_id: int, *, now: datetime, watchers: list[StreamWatcher]) -> list[Violation]:
    found: list[Violation] = []
    for check in (tasks_end_as_expected, side_effects_once, events_gapless_and_ordered, notifications_told_once,
                  thread_seqs_gapless):
        found += check(tenant_id)
    found += no_stale_leases(tenant_id, now=now)
    found += liveness_holds(tenant_id, now=now)
    found += streams_match_the_database(watchers)
    return found


def liveness_holds(tenant_id: int, *, now: datetime) -> list[Violation]:
    """The runtime's own liveness rules (tasks/liveness.py) hold for this tenant's rows, and the
    sweeper never had to repair one during the drill."""
    from tasks import liveness
    from tasks.models import Alert

    tasks = set(Task.objects.filter(tenant_id=tenant_id).values_list("pk", flat=True))
    ops = set(Operation.objects.filter(task__tenant_id=tenant_id).values_list("pk", flat=True))
    found = [Violation(f"liveness rule {v.rule}", f"{v.table} {v.row_id}: {v.detail}")
             for v in liveness.find_violations(now)
             if (v.table == "operation" and v.row_id in ops) or (v.rule == "admission_missed" and v.row_id == tenant_id)
             or (v.table in ("task", "notification") and v.rule != "admission_missed" and v.row_id in tasks)]
    for rule, message in Alert.objects.filter(kind=Alert.Kind.LIVENESS, task__tenant_id=tenant_id).values_list(
            "rule", "message"):
        found.append(Violation(f"liveness rule {rule} repaired during the drill", message[:300]))
    return found


def unexpected_ending(task: Task) -> str | None:
    """Why this task's status is not what its kind should end with under the drill's faults, if it is not."""
    if task.status not in TERMINAL and task.status != TaskStatus.PARTIAL:
        return f"still {task.status} (step {task.current_step}, lease {task.lease_owner or 'free'})"
    if task.kind == "sleep":
        # Its faults are kills, drains, restarts and transient failures within budget: it must finish.
        return None if task.status == TaskStatus.SUCCEEDED else \
            f"{task.status} ({task.error_class}: {task.error_message[:200]})"
    if task.status == TaskStatus.FAILED and task.error_class not in RESEARCH_MAY_FAIL_WITH:
        return f"failed with {task.error_class}: {task.error_message[:200]}"
    return None


def tasks_end_as_expected(tenant_id: int) -> list[Violation]:
    found = []
    for task in Task.objects.filter(tenant_id=tenant_id).order_by("pk"):
        why = unexpected_ending(task)
        if why:
            found.append(Violation("task ends as expected", f"task {task.pk} ({task.kind} {task.name!r}): {why}"))
    return found


def side_effects_once(tenant_id: int) -> list[Violation]:
    """SleepEffect rows are unique per (task, step), and a finished side-effecting task has one per step."""
    found = []
    twice = (SleepEffect.objects.filter(task__tenant_id=tenant_id).values("task_id", "step")
             .annotate(n=Count("id")).filter(n__gt=1))
    for row in twice:
        found.append(Violation("no side effect executed twice",
                               f"task {row['task_id']} step {row['step']}: {row['n']} SleepEffect rows"))
    for task in Task.objects.filter(tenant_id=tenant_id, kind="sleep", status=TaskStatus.SUCCEEDED):
        if not task.input.get("side_effect"):
            continue
        steps = sorted(set(SleepEffect.objects.filter(task=task).values_list("step", flat=True)))
        if steps != list(range(1, task.input["steps"] + 1)):
            found.append(Violation("every step's side effect happened",
                                   f"task {task.pk}: effects for steps {steps} of {task.input['steps']}"))
    return found


def events_gapless_and_ordered(tenant_id: int) -> list[Violation]:
    """Seqs are 1..last_event_seq; a finished task has exactly one ending event, and the last event
    carries the task's status."""
    found = []
    events: dict[int, list[tuple[int, str, str]]] = defaultdict(list)
    for task_id, seq, kind, status in (TaskEvent.objects.filter(task__tenant_id=tenant_id)
                                       .order_by("task_id", "seq").values_list("task_id", "seq", "kind", "status")):
        events[task_id].append((seq, kind, status))
    for task in Task.objects.filter(tenant_id=tenant_id).order_by("pk"):
        mine = events.get(task.pk, [])
        seqs = [seq for seq, _, _ in mine]
        if seqs != list(range(1, task.last_event_seq + 1)):
            found.append(Violation("event seqs gapless and ordered",
                                   f"task {task.pk}: seqs {_ranges(seqs)}, last_event_seq {task.last_event_seq}"))
            continue
        if task.status in TERMINAL or task.status == TaskStatus.PARTIAL:
            endings = [kind for _, kind, _ in mine if kind in TERMINAL_EVENTS]
            if len(endings) != 1:
                found.append(Violation("a finished task ended once", f"task {task.pk}: ending events {endings}"))
        if mine and mine[-1][2] != task.status:
            found.append(Violation("the last event tells the task's status",
                                   f"task {task.pk}: last event #{mine[-1][0]} {mine[-1][1]} says {mine[-1][2]}, "
                                   f"the task is {task.status}"))
    return found


def thread_seqs_gapless(tenant_id: int) -> list[Violation]:
    """Each thread numbers its messages 1..message_seq, and its stream items 1..item_seq after numbering
    what is new (tasks are not deleted during a drill, so neither has a gap)."""
    from chat.streams import number_new_items

    found = []
    for thread in Thread.objects.filter(tenant_id=tenant_id).order_by("pk"):
        number_new_items(thread.pk)
        thread.refresh_from_db()
        for name, seqs, last in (
                ("message", list(thread.messages.order_by("seq").values_list("seq", flat=True)), thread.message_seq),
                ("stream item", list(thread.items.order_by("seq").values_list("seq", flat=True)), thread.item_seq)):
            if seqs != list(range(1, last + 1)):
                found.append(Violation(f"{name} seqs gapless per thread",
                                       f"thread {thread.pk}: {_ranges(seqs)}, last {last}"))
    return found


def notifications_told_once(tenant_id: int) -> list[Violation]:
    """Each notification version produced one assistant message; a finished task's newest version is told."""
    found = []
    replies = Counter(
        Message.objects.filter(run__tenant_id=tenant_id, run__kind=Run.Kind.NOTIFICATION, role=Message.Role.ASSISTANT)
        .values_list("run__task_id", "run__task_version"))
    for (task_id, version), n in sorted(replies.items()):
        if n != 1:
            found.append(Violation("each notification version told once",
                                   f"task {task_id} v{version}: {n} assistant messages"))
    for task in Task.objects.filter(tenant_id=tenant_id, thread__isnull=False):
        if task.status not in TERMINAL and task.status != TaskStatus.PARTIAL:
            continue
        if task.event_version < 1 or task.notified_version != task.event_version:
            found.append(Violation("a finished task's news is delivered",
                                   f"task {task.pk} ({task.status}): event_version {task.event_version}, "
                                   f"notified_version {task.notified_version}, {task.notification_status}"
                                   f"{': ' + task.notification_error[:200] if task.notification_error else ''}"))
        elif replies.get((task.pk, task.event_version), 0) != 1:
            found.append(Violation("each notification version told once",
                                   f"task {task.pk} v{task.event_version} delivered with "
                                   f"{replies.get((task.pk, task.event_version), 0)} assistant messages"))
    return found


def no_stale_leases(tenant_id: int, *, now: datetime) -> list[Violation]:
    """After quiescence nothing is held by anybody: a lease still set past its expiry was left by a
    worker that died or forgot it."""
    found = []
    for pk, owner, expires in (Task.objects.filter(tenant_id=tenant_id).exclude(lease_owner="")
                               .values_list("pk", "lease_owner", "lease_expires_at")):
        if expires is None or expires < now:
            found.append(Violation("no lease left held after expiry",
                                   f"task {pk}: step lease of {owner}, expired {_when(expires)}"))
    for pk, owner, expires, status in (Task.objects.filter(tenant_id=tenant_id).exclude(notification_lease_owner="")
                                       .values_list("pk", "notification_lease_owner", "notification_lease_expires_at",
                                                    "notification_status")):
        if expires is None or expires < now:
            found.append(Violation("no lease left held after expiry",
                                   f"task {pk}: notification lease of {owner} ({status}), expired {_when(expires)}"))
    for op in Operation.objects.filter(task__tenant_id=tenant_id, status=OperationStatus.STARTED):
        found.append(Violation("no operation left unfinished",
                               f"operation {op.key} ({op.kind} {op.name}) started by {op.lease_owner or '?'}"))
    for run in Run.objects.filter(tenant_id=tenant_id, status__in=[Run.Status.PENDING, Run.Status.RUNNING]):
        found.append(Violation("no chat run left unfinished", f"run {run.pk} ({run.kind}) {run.status}, "
                               f"lease {run.lease_owner or 'free'} until {run.lease_expires_at}"))
    for pk, status in (Task.objects.filter(tenant_id=tenant_id, notification_status__in=[
            NotificationStatus.CLAIMED, NotificationStatus.DISPATCHED, NotificationStatus.PENDING,
            NotificationStatus.RETRY, NotificationStatus.DEAD_LETTER]).values_list("pk", "notification_status")):
        found.append(Violation("no notification left in flight", f"task {pk}: {status}"))
    return found


def streams_match_the_database(watchers: list[StreamWatcher]) -> list[Violation]:
    """Each watcher saw the task's events exactly once, in order, then the end message."""
    found = []
    for watcher in watchers:
        task = Task.objects.filter(public_id=watcher.task_public_id).first()
        if task is None:
            found.append(Violation("the stream is the database's sequence", f"{watcher.task_public_id}: no such task"))
            continue
        expected = list(TaskEvent.objects.filter(task=task).order_by("seq").values_list("seq", "kind"))
        seen = [(frame.get("seq"), frame.get("kind")) for frame in watcher.received]
        if seen != expected:
            found.append(Violation("the stream is the database's sequence",
                                   f"task {task.pk}: streamed {_diff(seen, expected)} over {watcher.connections} "
                                   f"connections"))
        if watcher.end is None:
            found.append(Violation("the stream ends", f"task {task.pk} ({task.status}): no end message after "
                                   f"{watcher.connections} connections; closes {watcher.server_closes[-5:]}"))
        elif watcher.end.get("status") != task.status or watcher.end.get("result_version") != task.result_version:
            found.append(Violation("the stream ends", f"task {task.pk}: end {watcher.end}, task {task.status} "
                                   f"v{task.result_version}"))
    return found


def _when(moment: datetime | None) -> str:
    return f"{moment:%H:%M:%S.%f}" if moment else "never (no expiry)"


def _diff(seen: list, expected: list) -> str:
    counts = Counter(seen)
    twice = sorted(s for s, n in counts.items() if n > 1)
    missing = [e for e in expected if e not in counts]
    extra = [s for s in counts if s not in set(expected)]
    first = next((i for i, (a, b) in enumerate(zip(seen, expected)) if a != b), min(len(seen), len(expected)))
    return (f"{len(seen)} frames vs {len(expected)} events; first difference at #{first + 1}; "
            f"twice {twice[:5]}, missing {missing[:5]}, extra {extra[:5]}")


def _ranges(seqs: list[int]) -> str:
    if len(seqs) <= 12:
        return str(seqs)
    return f"[{seqs[0]}..{seqs[-1]}] ({len(seqs)} seqs, {len(set(seqs))} distinct)"
