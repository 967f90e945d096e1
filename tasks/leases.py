"""Claim, renew and check a task's lease. The fencing token is the lease's identity:
it moves on with every claim, and every write a step makes is guarded by it."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.db import connection, transaction
from django.db.models import Q, QuerySet

from tasks import transitions
from tasks.errors import LeaseLost
from tasks.models import Checkpoint, Operation, Task
from tasks.statuses import CLAIMABLE, TaskStatus


def worker_identity() -> str:
    """host:pid of this process; operators read it in the admin, fault drills kill it."""
    return f"{socket.gethostname()}:{os.getpid()}"


def lease_seconds() -> float:
    return float(settings.LONGHAUL_LEASE_SECONDS)


def due(now: datetime) -> QuerySet[Task]:
    """Tasks whose next step is due and which nobody holds (or whose holder stopped renewing its lease),
    by the due-task index: what a kick, a worker going on to the next task and the sweeper look for."""
    return Task.objects.filter(status__in=CLAIMABLE, next_run_at__lte=now).filter(
        Q(lease_owner="") | Q(lease_expires_at__lt=now))


def claim(task_id: int, *, owner: str, now: datetime) -> Task | None:
    """Take the lease of a task that is claimable, due and not held; None if it is not."""
    if connection.vendor != "postgresql":
        return _claim(due(now).filter(pk=task_id), owner=owner, now=now)
    return _claim_in_one(owner=owner, now=now, task_id=task_id)


def claim_next(*, owner: str, now: datetime) -> Task | None:
    """Take the lease of the task due longest that nobody holds; None if there is none. A worker that has
    just run a step goes on with this one instead of a broker round trip (tasks/runner.py)."""
    if connection.vendor != "postgresql":
        return _claim(due(now).order_by("next_run_at", "pk"), owner=owner, now=now)
    return _claim_in_one(owner=owner, now=now)


@dataclass(frozen=True)
class Resume:
    """What a step resumed from the database reads first, read by the statement that claimed its task
    (Task.resume): the task's latest checkpoint, and whether the step before asked for any call (when
    it did not, there are no outcomes to read and nothing to wait for)."""

    checkpoint: Checkpoint | None
    calls_asked: bool


def _claim_in_one(*, owner: str, now: datetime, task_id: int | None = None) -> Task | None:
    """PostgreSQL: the task due longest (or task `task_id`, if due), claimed in one statement when it is
    between two steps, with its Resume; the full claim otherwise."""
    running = TaskStatus.RUNNING.value
    params = [running, *sorted(str(status) for status in CLAIMABLE), now, now,
              *([] if task_id is None else [task_id]),
              running, now, owner, now + timedelta(seconds=lease_seconds()), now]
    sql = _CLAIM_NEXT.format(task=Task._meta.db_table, checkpoint=Checkpoint._meta.db_table,
                             operation=Operation._meta.db_table, claimable=", ".join(["%s"] * len(CLAIMABLE)),
                             only="" if task_id is None else "AND id = %s")
    picked = next(iter(Task.objects.raw(sql, params)), None)
    if picked is None:
        return None
    if picked.claimed:
        picked.resume = _resume_of(picked)
        return picked
    # A retry, a takeover or a first claim: transitions.claim writes its event or admission record.
    return _claim(due(now).filter(pk=picked.pk), owner=owner, now=now)


# leases.due() in one statement, oldest first (or only the task asked for): the task due longest is locked;
# when it is between two steps (no takeover, no retry, not its first claim) it is claimed as transitions.claim
# would (no event, no admission record then) and returned with `claimed`, beside what its step reads first
# (its latest checkpoint, and whether the step before asked for calls); otherwise it is returned as it is,
# for the full claim.
_CLAIM_NEXT = """
WITH picked AS (
    SELECT id, (status = %s AND lease_owner = '' AND (current_step > 0 OR attempts > 0)) AS plain
    FROM {task}
    WHERE status IN ({claimable}) AND next_run_at <= %s AND (lease_owner = '' OR lease_expires_at < %s) {only}
    ORDER BY next_run_at, id LIMIT 1 FOR UPDATE SKIP LOCKED
), taken AS (
    UPDATE {task} t SET status = %s, version = t.version + 1, updated_at = %s, lease_owner = %s,
        lease_expires_at = %s, heartbeat_at = %s, fencing_token = t.fencing_token + 1,
        attempts = t.attempts + 1, waiting_reason = ''
    FROM picked WHERE t.id = picked.id AND picked.plain
    RETURNING t.*
)
SELECT taken.*, true AS claimed, cp.id AS cp_id, cp.step AS cp_step, cp.fencing_token AS cp_fencing_token,
    cp.state AS cp_state, cp.schema_version AS cp_schema_version, cp.at AS cp_at,
    EXISTS (SELECT 1 FROM {operation} o WHERE o.task_id = taken.id AND o.step = taken.current_step - 1)
        AS calls_asked
FROM taken LEFT JOIN LATERAL (
    SELECT * FROM {checkpoint} c WHERE c.task_id = taken.id ORDER BY c.step DESC LIMIT 1) cp ON true
UNION ALL
SELECT t.*, false AS claimed, NULL, NULL, NULL, NULL, NULL, NULL, NULL
FROM {task} t JOIN picked ON picked.id = t.id WHERE NOT picked.plain
"""


def _resume_of(picked: Task) -> Resume:
    """What the claim read beside the row: the checkpoint (its sealed state opened as a read would)."""
    if picked.cp_id is None:
        return Resume(checkpoint=None, calls_asked=picked.calls_asked)
    row = {"id": picked.cp_id, "task_id": picked.pk, "step": picked.cp_step, "fencing_token": picked.cp_fencing_token,
           "state": Checkpoint._meta.get_field("state").from_db_value(picked.cp_state, None, connection),
           "schema_version": picked.cp_schema_version, "at": picked.cp_at}
    # In the model's column order, as from_db takes them (a column added to Checkpoint fails here, loudly).
    names = [field.attname for field in Checkpoint._meta.concrete_fields]
    checkpoint = Checkpoint.from_db(connection.alias, names, [row[name] for name in names])
    return Resume(checkpoint=checkpoint, calls_asked=picked.calls_asked)


def _claim(rows: QuerySet[Task], *, owner: str, now: datetime) -> Task | None:
    """SKIP LOCKED: a row another transaction is claiming is not worth waiting for.
    SQLite has no row locks; there the IMMEDIATE transaction serializes claims."""
    with transaction.atomic():
        task = rows.select_for_update(skip_locked=True).first()
        if task is None:
            return None
        expires_at = now + timedelta(seconds=lease_seconds())
        if not transitions.claim(task, owner=owner, now=now, expires_at=expires_at):
            return None
        return task


def renew(task_id: int, *, owner: str, token: int, now: datetime) -> bool:
    """Heartbeat: push the lease expiry forward while the step runs. False: the lease is gone."""
    return (
        Task.objects.filter(pk=task_id, fencing_token=token, lease_owner=owner)
        .update(lease_expires_at=now + timedelta(seconds=lease_seconds()), heartbeat_at=now)
        == 1
    )


def lock_fenced(task_id: int, token: int) -> Task:
    """Inside a transaction: lock the task row and prove the caller still holds the lease."""
    task = Task.objects.select_for_update().filter(pk=task_id).first()
    if task is None or task.fencing_token != token or not task.lease_owner:
        raise LeaseLost(f"task {task_id}: fencing token {token} is stale")
    return task
