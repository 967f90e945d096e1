"""Claim, renew and check a task's lease. The fencing token is the lease's identity:
it moves on with every claim, and every write a step makes is guarded by it."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import lru_cache
from typing import Any

from django.conf import settings
from django.db import connection, transaction
from django.db.models import CharField, Field, JSONField, Q, QuerySet, TextField
from django.db.models.sql import Query

from tasks import broker, prepared, sealed, transitions
from tasks.errors import LeaseLost
from tasks.models import AdmissionRecord, Checkpoint, Operation, Task
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


# due() as SQL, for the prepared statements (the claim below, kicks.waiting); its two parameters are now and
# now. The statuses are literals, so the plan PostgreSQL keeps for every call (one plan, whatever the
# parameters) can prove task_due_idx's predicate.
DUE_WHERE = ("status IN ({}) AND next_run_at <= %s AND (lease_owner = '' OR lease_expires_at < %s)"
             .format(", ".join(f"'{status}'" for status in sorted(CLAIMABLE))))


def claim(task_id: int, *, owner: str, now: datetime) -> Task | None:
    """Take the lease of a task that is claimable, due and not held; None if it is not.

    A row another transaction has locked is waited for, then looked at again: this task's kick is the
    only hint the job has, and skipped, the step would wait for the sweeper's next pass (a recorder of the
    task's last call, say, holds the row at the very moment a cancel's kick arrives)."""
    if connection.vendor != "postgresql":
        return _claim(due(now).filter(pk=task_id), owner=owner, now=now, wait=True)
    return _claim_in_one(owner=owner, now=now, task_id=task_id)


def claim_next(*, owner: str, now: datetime) -> Task | None:
    """Take the lease of the task due longest that nobody holds; None if there is none. A worker that has
    just run a step goes on with this one instead of a broker round trip (tasks/runner.py)."""
    if connection.vendor != "postgresql":
        return _claim(due(now).order_by("next_run_at", "pk"), owner=owner, now=now)
    return _claim_in_one(owner=owner, now=now)


CLAIM_ROUNDS = 3  # claim_due_longest's looks at the due rows other transactions held


def claim_due_longest(*, owner: str, now: datetime) -> Task | None:
    """claim_next for a kick that is for the task due longest (kicks.DUE_LONGEST). When every due task is locked by
    another transaction, the first of them is waited for, as a kick for one task waits (see claim), and the
    others looked at again once it is free: this kick may be the only one on its way for them all, and a row
    locked by something other than a claim (a recorder closing a call of a task already due, say) would
    otherwise wait for the sweeper. A row another worker claimed meanwhile has that worker's turn on its way,
    which ends kicking the task due longest. A few rounds, then the sweeper."""
    for _ in range(CLAIM_ROUNDS):
        task = claim_next(owner=owner, now=now)
        if task is not None:
            return task
        first = due(now).order_by("next_run_at", "pk").values_list("pk", flat=True).first()
        if first is None:
            return None
        task = claim(first, owner=owner, now=now)
        if task is not None:
            return task
    return None


@dataclass(frozen=True)
class Waiting:
    """What waits for a worker that has just run a step (tasks/runner.py decides by it whether to go on)."""

    jobs: bool  # due work in this cluster's own queue (deliveries, sweeps), or a gateway kick nobody hears
    steps: bool  # another task whose step is due, held by nobody (its kick, if any, is only a hint)


@dataclass(frozen=True)
class Resume:
    """What a step resumed from the database reads first, read by the statement that claimed its task
    (Task.resume): the task's latest checkpoint, and the calls the step before asked a gateway job for, in
    request order, with CALL_FIELDS alone loaded (none when it asked for none: nothing to read, nothing to wait
    for; operations.read_outcomes reads them). Beside them, what else waited for a worker at the claim
    (kicks.waiting's answer) and when it was asked (time.monotonic() as the claim was sent): a short step
    reads it instead of asking again before its commit (tasks/runner.py)."""

    checkpoint: Checkpoint | None
    calls: tuple[Operation, ...] = ()
    waiting: Waiting | None = None
    read_at: float = 0.0


def _claim_in_one(*, owner: str, now: datetime, task_id: int | None = None) -> Task | None:
    """PostgreSQL: the task due longest (or task `task_id`, if due), claimed in one prepared statement
    when nobody held it and it waits for no retry, with its Resume; the full claim otherwise."""
    sql, params = claim_statement(owner=owner, now=now, task_id=task_id)
    # The statement's answer about what waits is as old as the moment it was sent, not the moment it came
    # back: a claim by kick may wait for its row's lock.
    asked_at = time.monotonic()
    row = prepared.fetchone(sql, params)
    if row is None:
        return None
    picked = _task_of(row)
    claimed, *checkpoint, calls, jobs, steps = row[len(_TASK_FIELDS):]
    if claimed:
        # The checkpoint's and the calls' checks of their tenant read it.
        sealed.remember_tenant(Task, picked.pk, picked.tenant_id)
        resume = _resume_of(picked, checkpoint, call_rows=calls or (), waiting=Waiting(jobs=jobs, steps=steps),
                            read_at=asked_at)
        # The row is the one the claim locked, which may be newer than what the statement's reads beside it
        # saw: a claim by kick that waited for another worker's commit returns the row that commit wrote, but
        # reads the checkpoint and the calls as they were when it started. Read then, they are not this step's,
        # and the step reads them itself.
        latest = resume.checkpoint.step if resume.checkpoint is not None else 0
        picked.resume = resume if latest == picked.current_step else None
        return picked
    # A retry or a takeover: transitions.claim writes its event.
    return _claim(due(now).filter(pk=picked.pk), owner=owner, now=now, wait=task_id is not None)


def claim_statement(*, owner: str, now: datetime, task_id: int | None = None) -> tuple[str, list[Any]]:
    """The one-statement claim (PostgreSQL) and its parameters: of the task due longest, or of task `task_id`."""
    params = [now, now, *([] if task_id is None else [task_id]),
              now, owner, now + timedelta(seconds=lease_seconds()), now, now,
              *broker.jobs_waiting_params(now, postgresql=True), now, now]
    return _claim_next_sql(one=task_id is not None), params


# leases.due() in one statement, oldest first (or only the task asked for): the task due longest is locked
# (skipping rows another transaction holds: any other due task will do), or the task asked for (waiting for it);
# when nobody held it and it waits for no retry (no takeover, no retry: no event to write) it is claimed as
# transitions.claim would, its first claim also recording in its admission record when it started, and returned
# claimed, beside what its step reads first (its latest checkpoint, and the calls the step before asked a gateway
# job for, as operations.outcomes_and_wait reads them: a JSON array of CALL_FIELDS, its sealed and JSON columns as
# their text, which the fields' converters then open), and what else waits for a worker (kicks.waiting's two
# questions, the claimed task left out);
# otherwise it is returned as it is, for the full claim. The task's columns are named, in the model's order
# (tasks/prepared.py says why not `*`).
_CLAIM_NEXT = """
WITH picked AS (
    SELECT id, (status = {running} AND lease_owner = '') AS plain
    FROM {task}
    WHERE {due} {only}
    ORDER BY next_run_at, id LIMIT 1 FOR UPDATE {skip_locked}
), taken AS (
    UPDATE {task} t SET status = {running}, version = t.version + 1, updated_at = %s, lease_owner = %s,
        lease_expires_at = %s, heartbeat_at = %s, fencing_token = t.fencing_token + 1,
        attempts = t.attempts + 1, waiting_reason = ''
    FROM picked WHERE t.id = picked.id AND picked.plain
    RETURNING {columns_of_t}
), started AS (
    -- admission_records.started: the first claim of its first step (attempts was 0 before this claim)
    UPDATE {admission} a SET started_at = %s FROM taken
    WHERE a.task_id = taken.id AND a.started_at IS NULL AND taken.current_step = 0 AND taken.attempts = 1
)
SELECT {columns_of_taken}, true, {columns_of_cp},
    (SELECT json_agg(json_build_array({columns_of_o}) ORDER BY o.n, o.id) FROM {operation} o
     WHERE o.task_id = taken.id AND o.step = taken.current_step - 1 AND o.mode = {gateway}
         AND NOT starts_with(o.key, taken.id || ':' || (taken.current_step - 1) || ':a')),
    EXISTS ({jobs_waiting}),
    EXISTS (SELECT 1 FROM {task} d WHERE {due} AND d.id <> taken.id LIMIT 1)
FROM taken LEFT JOIN LATERAL (
    SELECT {columns_of_c} FROM {checkpoint} c
    WHERE c.task_id = taken.id ORDER BY c.step DESC LIMIT 1) cp ON true
UNION ALL
SELECT {columns_of_t}, false, {no_checkpoint}, NULL, NULL, NULL
FROM {task} t JOIN picked ON picked.id = t.id WHERE NOT picked.plain
"""
_TASK_FIELDS = tuple(Task._meta.concrete_fields)
_TASK_NAMES = [field.attname for field in _TASK_FIELDS]
# What a step reads of its checkpoint (task_id is the claimed task's own).
_CHECKPOINT_FIELDS = tuple(Checkpoint._meta.get_field(name)
                           for name in ("id", "step", "fencing_token", "state", "schema_version", "at"))
# What a step reads of each call the step before asked for (operations.read_outcomes), its task's id aside. The claim
# reads them through JSON, as a number (the id) or text, which their fields' converters then read (a column of
# another type would come back as text).
CALL_FIELDS = ("id", "key", "name", "args", "status", "result", "error_class", "error_message", "usage")
_CALL_FIELDS = tuple(Operation._meta.get_field(name) for name in CALL_FIELDS)
assert all(field.primary_key or isinstance(field, (CharField, TextField, JSONField)) for field in _CALL_FIELDS)


@lru_cache(maxsize=2)
def _claim_next_sql(*, one: bool) -> str:
    def columns(alias: str, fields: Sequence[Field] = _TASK_FIELDS) -> str:
        return ", ".join(f"{alias}.{connection.ops.quote_name(field.column)}" for field in fields)

    return _CLAIM_NEXT.format(task=Task._meta.db_table, checkpoint=Checkpoint._meta.db_table,
                              admission=AdmissionRecord._meta.db_table,
                              operation=Operation._meta.db_table, running=f"'{TaskStatus.RUNNING.value}'",
                              gateway=f"'{Operation.Mode.GATEWAY.value}'", columns_of_o=", ".join(
                                  f"o.{connection.ops.quote_name(field.column)}"
                                  + ("::text" if isinstance(field, JSONField) else "") for field in _CALL_FIELDS),
                              jobs_waiting=broker.jobs_waiting_sql(postgresql=True),
                              due=DUE_WHERE, only="AND id = %s" if one else "",
                              skip_locked="" if one else "SKIP LOCKED", columns_of_t=columns("t"),
                              columns_of_taken=columns("taken"), columns_of_c=columns("c", _CHECKPOINT_FIELDS),
                              columns_of_cp=columns("cp", _CHECKPOINT_FIELDS),
                              no_checkpoint=", ".join(["NULL"] * len(_CHECKPOINT_FIELDS)))


def _task_of(row: tuple) -> Task:
    """The Task of the claim's row (its first columns), through the fields' converters as a query's would be."""
    return Task.from_db(connection.alias, _TASK_NAMES, _converted(Task, _TASK_FIELDS, row[:len(_TASK_FIELDS)]))


def _converted(model: type, fields: tuple[Field, ...], values: Sequence[Any]) -> list[Any]:
    """`values` of `fields` as a query of Django's would return them (its backend's and the fields' converters)."""
    converted, db = list(values), prepared.database()
    for position, (converters, expression) in _converters(model, fields).items():
        for converter in converters:
            converted[position] = converter(converted[position], expression, db)
    return converted


@lru_cache(maxsize=4)
def _converters(model: type, fields: tuple[Field, ...]) -> dict[int, tuple[list, Any]]:
    compiler = connection.ops.compiler("SQLCompiler")(Query(model), connection, connection.alias)
    return compiler.get_converters([field.get_col(model._meta.db_table) for field in fields])


def _resume_of(task: Task, checkpoint: Sequence[Any], *, call_rows: Sequence[Sequence[Any]], waiting: Waiting,
               read_at: float) -> Resume:
    """What the claim read beside the row: the checkpoint's columns (all NULL when it has none yet) and the
    calls' rows, through the fields' converters and from_db, as a read makes them (sealed state, arguments and
    results opened, and refused when sealed for another tenant)."""
    calls = tuple(_operation_of(task, _converted(Operation, _CALL_FIELDS, row)) for row in call_rows)
    if checkpoint[0] is None:
        return Resume(checkpoint=None, calls=calls, waiting=waiting, read_at=read_at)
    values = dict(zip((field.attname for field in _CHECKPOINT_FIELDS),
                      _converted(Checkpoint, _CHECKPOINT_FIELDS, checkpoint), strict=True))
    values["task_id"] = task.pk
    # In the model's column order, as from_db takes them (a column added to Checkpoint fails here, loudly).
    names = [field.attname for field in Checkpoint._meta.concrete_fields]
    return Resume(checkpoint=Checkpoint.from_db(connection.alias, names, [values[name] for name in names]),
                  calls=calls, waiting=waiting, read_at=read_at)


# The fields a call is read with, in the model's column order (as from_db takes them), and where each is in a row of
# the claim's (its task's id first, then CALL_FIELDS).
_CALL_NAMES = ["task_id", *CALL_FIELDS]
_CALL_READ = [(field.attname, _CALL_NAMES.index(field.attname)) for field in Operation._meta.concrete_fields
              if field.attname in _CALL_NAMES]


def _operation_of(task: Task, values: Sequence[Any]) -> Operation:
    """An Operation of `task` with CALL_FIELDS alone loaded, from their converted values."""
    row = [task.pk, *values]
    return Operation.from_db(connection.alias, [name for name, _ in _CALL_READ], [row[at] for _, at in _CALL_READ])


def _claim(rows: QuerySet[Task], *, owner: str, now: datetime, wait: bool = False) -> Task | None:
    """SKIP LOCKED unless `wait`: for the task due longest, a row another transaction is claiming is not
    worth waiting for; a kick for one task waits (see claim). PostgreSQL reads the row again once the lock
    is released, and takes it only if it is still due and free.
    SQLite has no row locks; there the IMMEDIATE transaction serializes claims."""
    with transaction.atomic():
        task = rows.select_for_update(skip_locked=not wait).first()
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
