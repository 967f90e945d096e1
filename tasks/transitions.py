"""Every change of a task's status, one small function each.

Each function issues one conditional UPDATE guarded by the status and `version`
the caller read (and, for a worker, its fencing token), appends the matching
event in the same transaction, and returns whether it won. A caller that asks
for a move the state machine forbids gets InvalidTransition; a caller that lost
a race gets False and must re-read, never overwrite.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

from django.db import connection
from django.db.models import F, Field, Q
from django.db.models.sql.subqueries import UpdateQuery

from tasks import admission_records, prepared, sealed, typed_sql
from tasks.errors import InvalidTransition
from tasks.events import NewEvent, append, heard, unsaved, written
from tasks.models import Checkpoint, Operation, Pool, Task, TaskEvent
from tasks.statuses import ACTIVE, CLAIMABLE, HOLDS_SLOT, TERMINAL, OperationStatus, TaskStatus

TOLD = frozenset({TaskStatus.WAITING_INPUT, TaskStatus.PARTIAL, TaskStatus.SUCCEEDED, TaskStatus.FAILED,
                  TaskStatus.CANCELLED})

S = TaskStatus
# waiting_reason of a task ending by a remote cancel: queued for its slot, then running the cancel rounds.
CANCEL_WAIT = "cancel"
NOT_HELD = Q(lease_owner="")
# A step committed without reading the row first (tasks/runner.py) wins only while nobody asked it to stop
# or to give its slot back.
NO_STOP_REQUESTED = Q(cancel_requested_at__isnull=True, pause_requested_at__isnull=True,
                      yield_requested_at__isnull=True)


def _lease_free(now: datetime) -> Q:
    """Nobody holds the lease, or its holder stopped renewing it."""
    return Q(lease_owner="") | Q(lease_expires_at__lt=now)


def _move(
    task: Task,
    to: TaskStatus,
    *,
    allowed_from: frozenset[str] | set[str],
    now: datetime,
    token: int | None = None,
    guard: Q | None = None,
    fields: dict[str, Any] | None = None,
    events: list[NewEvent],
    checkpoint: Checkpoint | None = None,
    alone: bool = False,
    calls: Sequence[Operation] = (),
    also: tuple[str, list[Any]] | None = None,
) -> bool:
    """`checkpoint`: the step's, written by the transition's own UPDATE, only if it wins; so are `calls`, the
    pending calls a step asks for, and `also` (see _update_reserving_seqs). `alone`: the UPDATE commits by
    itself, outside any transaction (commits_alone says when it may)."""
    if task.status not in allowed_from:
        raise InvalidTransition(task.public_id, task.status, to)
    if alone:
        # Running on, or waiting for its calls with its slot kept: a move that writes nothing after its UPDATE.
        assert task.status == S.RUNNING and to in (S.RUNNING, S.WAITING_TOOL) and commits_alone(events), (
            "only a step's commit writes nothing more")
    else:
        assert connection.in_atomic_block, "a transition and its event commit together"
    match: dict[str, Any] = {"id": task.pk, "status": task.status, "version": task.version}
    if token is not None:
        match["fencing_token"] = token
    values = dict(fields or {})
    values.update(status=to, version=task.version + 1, updated_at=now)
    if task.status in HOLDS_SLOT and to not in HOLDS_SLOT:
        # A request to give back a slot it no longer holds (the row's, which `task` may not show). A task
        # that waits for calls or a retry keeps it, and gives the slot back when it next runs.
        values.setdefault("yield_requested_at", None)
    # The events' rows are numbered 1..n here; the UPDATE that reserves their seqs numbers them for good.
    logged = unsaved(task, events, last=len(events), status=to, at=now)
    last_seq = _update_reserving_seqs(match, guard, sealed.wrap(Task, task.tenant_id, values), logged,
                                      checkpoint=checkpoint, calls=calls, now=now, also=also)
    if last_seq is None:
        return False
    was = task.status
    for name, value in values.items():
        setattr(task, name, value)
    written(task, logged, last=last_seq)
    if to in TOLD:
        from tasks import notifications  # imported here: notifications builds on leases, which builds on us

        notifications.note(task, event=to, now=now)
    if to in TERMINAL:
        _close_pending_operations(task, now=now)
    elif was == S.WAITING_INPUT:
        _close_pending_watch(task, now=now)
    frees_slot = was in HOLDS_SLOT and to not in HOLDS_SLOT
    if frees_slot or to in TERMINAL:
        admission_records.released(task, slot=frees_slot, ended=to in TERMINAL, now=now)
    _admit_after(was, to, now=now)
    return True


def commits_alone(events: list[NewEvent]) -> bool:
    """Whether a step's move with `events` may commit as its UPDATE alone, in autocommit: on PostgreSQL the
    statement writes the checkpoint and the events too (and the calls of wait_for_operations), and those moves,
    running -> running or -> waiting_tool, write nothing else (no slot is freed, nobody is told) unless a
    listener hears one of the events (webhooks' outbox, whose rows must commit with them). A step's commit then
    costs no BEGIN and COMMIT round trips."""
    return connection.vendor == "postgresql" and not heard(event.kind for event in events)


def _update_reserving_seqs(match: dict[str, Any], guard: Q | None, values: dict[str, Any], events: list[TaskEvent],
                           *, checkpoint: Checkpoint | None = None, calls: Sequence[Operation] = (),
                           now: datetime | None = None, also: tuple[str, list[Any]] | None = None) -> int | None:
    """The transition's UPDATE of the row whose columns equal `match` (and meets `guard`), which also reserves
    the seqs of `events` on it (one statement where an UPDATE and then a seq bump were two) and, when it wins,
    writes them, `checkpoint` and `calls` (it then wins only while none of the calls' pools is paused at `now`:
    a pause is news the task's events tell, which the caller's locked commit writes). Returns the last seq
    reserved (the row's seq if there are no events), or None when the guard matched no row. `events` come
    numbered from 1 and leave numbered for good. `also` (PostgreSQL, with `calls`): one more statement of the
    same, an INSERT ... SELECT ... FROM moved, and its parameters.

    On PostgreSQL the rows are inserted by the same statement, from the UPDATE's RETURNING: the UPDATE, the
    checkpoint, the events and the calls in one round trip. The statement is written here, its values prepared as
    update() and save() prepare them, and prepared on the connection (tasks/prepared.py): it is sent at every
    step, and compiling it through the ORM cost the worker more CPU than the database spent running it.
    SQLite's WITH cannot hold an INSERT, so there the ORM's UPDATE ... RETURNING goes first and the rows are
    saved after an UPDATE that won."""
    count = len(events)
    assert [event.seq for event in events] == list(range(1, count + 1)), "the SQL numbers them from their seqs"
    seq = connection.ops.quote_name("last_event_seq")
    if connection.vendor != "postgresql":
        assert not calls, "a step's calls are stored with its move on PostgreSQL alone"
        return _update_then_save(match, guard, values, events, checkpoint=checkpoint)
    sql, params = _fenced_update(match, guard, values, reserved=count)
    if calls:
        assert now is not None, "the pools' pauses are looked at as of the move"
        sql += f" AND NOT EXISTS ({_PAUSED})"
        params.extend([sorted({op.pool for op in calls}), now])
    ctes = [f"moved AS ({sql} RETURNING {seq})"]
    for group in ([checkpoint] if checkpoint is not None else [], events, calls):
        if group:
            model = type(group[0])
            ctes.append(f"saved_{model._meta.model_name} AS ({_insert_if_moved(model, len(group), reserved=count)})")
            params.extend(typed_sql.insert_params(model, _inserted_fields(model), group))
    if also is not None:
        assert calls, "the statement commits by itself only with calls"
        ctes.append(f"also_inserted AS ({also[0]})")
        params.extend(also[1])
    row = prepared.fetchone(f"WITH {', '.join(ctes)} SELECT {seq} FROM moved", params)
    if row is None:
        return None
    last = row[0]
    for event in events:
        event.seq += last - count
    return last


# Whether one of some pools (an array of keys) is paused at a time: the condition tasks/pools.py's paused_among reads,
# written out because compiling that query into the step's statement cost 0.5 ms of CPU a step.
_PAUSED = (f'SELECT 1 FROM "{Pool._meta.db_table}" WHERE "{Pool._meta.get_field("key").column}" = ANY(%s) '
           f'AND "{Pool._meta.get_field("paused_until").column}" > %s')


def _fenced_update(match: dict[str, Any], guard: Q | None, values: dict[str, Any], *,
                   reserved: int) -> tuple[str, list[Any]]:
    """The UPDATE of the task row whose columns equal `match` (and meets `guard`), setting `values` and
    reserving `reserved` seqs; the ORM compiles it when a value is more than a parameter."""
    assert "last_event_seq" not in values, "the seqs are reserved here, never set"
    qn = connection.ops.quote_name
    seq = qn("last_event_seq")
    written = typed_sql.set_items(Task, values)
    if written is None:
        return _orm_update(match, guard, values, reserved=reserved)
    items, params = written
    items.append(f"{seq} = {seq} + %s")
    params.append(reserved)
    conditions = []
    for name, value in match.items():
        field = Task._meta.get_field(name)
        conditions.append(f"{qn(Task._meta.db_table)}.{qn(field.column)} = %s")
        params.append(field.get_db_prep_value(value, connection))
    if guard is not None:
        condition, guard_params = _guard_sql(guard)
        conditions.append(condition)
        params.extend(guard_params)
    return (f"UPDATE {qn(Task._meta.db_table)} SET {', '.join(items)} WHERE {' AND '.join(conditions)}",
            params)


# Guards without parameters (NO_STOP_REQUESTED, NOT_HELD: the module's own constants) -> their SQL. A guard
# with a parameter (a time) is a new one at each call, and is compiled each time.
_GUARDS: dict[Q, str] = {}


def _guard_sql(guard: Q) -> tuple[str, tuple[Any, ...]]:
    """`guard` as the ORM writes it in a WHERE on the task table (columns named with the table's name)."""
    known = _GUARDS.get(guard)
    if known is not None:
        return known, ()
    query = Task.objects.filter(guard).query
    assert list(query.alias_map) == [Task._meta.db_table], f"a guard on the task row alone: {guard}"
    sql, params = query.get_compiler(connection=connection).compile(query.where)
    if not params:
        _GUARDS[guard] = sql
    return sql, tuple(params)


def _orm_update(match: dict[str, Any], guard: Q | None, values: dict[str, Any], *,
                reserved: int) -> tuple[str, list[Any]]:
    """The same UPDATE as the ORM compiles it (update() cannot return a column: the caller adds RETURNING)."""
    rows = Task.objects.filter(**match)
    if guard is not None:
        rows = rows.filter(guard)
    query = rows.query.chain(UpdateQuery)
    query.add_update_values({**values, "last_event_seq": F("last_event_seq") + reserved})
    sql, params = query.get_compiler(connection=connection).as_sql()
    return sql, list(params)


def _update_then_save(match: dict[str, Any], guard: Q | None, values: dict[str, Any], events: list[TaskEvent],
                      *, checkpoint: Checkpoint | None) -> int | None:
    """_update_reserving_seqs where a WITH cannot hold an INSERT (SQLite): the ORM's UPDATE ... RETURNING
    (SQLite 3.35+ has it), then the rows, saved when it won."""
    count = len(events)
    sql, params = _orm_update(match, guard, values, reserved=count)
    with connection.cursor() as cursor:
        cursor.execute(f"{sql} RETURNING {connection.ops.quote_name('last_event_seq')}", params)
        row = cursor.fetchone()
    if row is None:
        return None
    last = row[0]
    for event in events:
        event.seq += last - count
    if checkpoint is not None:
        checkpoint.save(force_insert=True)
    if events:
        TaskEvent.objects.bulk_create(events)
    return last


def _inserted_fields(model: type[Checkpoint] | type[TaskEvent] | type[Operation]) -> list[Field]:
    return [field for field in model._meta.local_concrete_fields if not field.primary_key]


@lru_cache(maxsize=64)
def _insert_if_moved(model: type[Checkpoint] | type[TaskEvent] | type[Operation], count: int, *, reserved: int) -> str:
    """An INSERT of `count` rows of `model` (their values typed_sql.insert_params's, a row after another), made
    an INSERT ... SELECT from the `moved` row of the statement it joins, so it writes only when the UPDATE won.
    An event's seq is the one its number (1..`reserved`) takes among the seqs the UPDATE reserved.

    The values are typed by casts (tasks/typed_sql.py). Checkpoint's, TaskEvent's and Operation's alone: their
    columns are numbers, times, booleans, JSON and texts. A column with a database default or a parent model's
    would need more than this."""
    assert model in (Checkpoint, TaskEvent, Operation), model
    fields = _inserted_fields(model)

    def value(field: Field) -> str:
        if model is TaskEvent and field.attname == "seq":
            return f"{connection.ops.quote_name('last_event_seq')} - {reserved} + CAST(%s AS bigint)"
        return typed_sql.typed_param(field)

    columns = ", ".join(connection.ops.quote_name(field.column) for field in fields)
    select = f"SELECT {', '.join(value(field) for field in fields)} FROM moved"
    table = connection.ops.quote_name(model._meta.db_table)
    return f"INSERT INTO {table} ({columns}) {' UNION ALL '.join([select] * count)}"


def _close_pending_operations(task: Task, *, now: datetime) -> None:
    """A task that ended will never read the calls it asked for: those no gateway job took yet are
    closed with it, so none waits forever (calls in flight record their outcome as usual)."""
    closed = {"status": OperationStatus.FAILED.value, "error_class": "cancelled",
              "error_message": "its task ended before it ran", "finished_at": now}
    if connection.vendor == "postgresql":  # every task's end: written out and prepared (see _CLOSE_PENDING)
        prepared.execute(_CLOSE_PENDING, [*closed.values(), task.pk])
        return
    Operation.objects.filter(task_id=task.pk, status=OperationStatus.PENDING).update(**closed)


# _close_pending_operations's UPDATE, written out: compiled by the ORM it cost 0.4 ms of CPU at every task's end,
# prepared 0.1 ms. The pending status is written in, as the calls' partial indexes on it are.
_CLOSE_PENDING = (f'UPDATE "{Operation._meta.db_table}" SET "status" = %s, "error_class" = %s, "error_message" = %s, '
                  f'"finished_at" = %s WHERE "{Operation._meta.get_field("task").column}" = %s '
                  f"AND \"status\" = '{OperationStatus.PENDING.value}'")


def _close_pending_watch(task: Task, *, now: datetime) -> None:
    """A task no longer waiting for its owner stops watching its remote task: the watch calls not
    yet taken are closed (one in flight records its outcome, which the next step may read)."""
    # task:step:w<n> (operations.WATCH_PREFIX; operations builds on this module, so not imported)
    Operation.objects.filter(task_id=task.pk, status=OperationStatus.PENDING, key__contains=":w").update(
        status=OperationStatus.FAILED, error_class="cancelled", error_message="its task stopped waiting for input",
        finished_at=now)


def _admit_after(was: str, to: str, *, now: datetime) -> None:
    """Admission is a consequence of the transitions that free a running slot or need one
    (DESIGN §4), decided here and nowhere else: the caller's transaction admits whoever is next."""
    frees_slot = was in HOLDS_SLOT and to not in HOLDS_SLOT
    if frees_slot or to == S.QUEUED:
        from tasks import scheduling  # imported here: scheduling admits through transitions.admit

        scheduling.admit(now=now)


def enqueue_new(task: Task, *, now: datetime, events: list[NewEvent]) -> None:
    """A task just created as queued: its first event, and admission if a slot is free."""
    assert connection.in_atomic_block, "a new task and its admission commit together"
    append(task, events, status=task.status, at=now)
    admission_records.arrived(task)
    _admit_after("", task.status, now=now)


def _released() -> dict[str, Any]:
    return {"lease_owner": "", "lease_expires_at": None}


def _finished(now: datetime) -> dict[str, Any]:
    return {**_released(), "finished_at": now, "next_run_at": None, "waiting_reason": "", "tracking_degraded": False}


# --- admission and claims --------------------------------------------------------


def admit(task: Task, *, now: datetime) -> bool:
    """queued -> running: the task got a slot; its first (or next) step is due now."""
    return _move(
        task,
        S.RUNNING,
        allowed_from={S.QUEUED},
        now=now,
        # attempts: kept, so a task that gave its slot back still counts the claims that never finished
        # its step (the poison check); every other way into the queue starts them at 0.
        fields={"next_run_at": now, "started_at": task.started_at or now},
        events=[NewEvent("admitted")],
    )


def claim(task: Task, *, owner: str, now: datetime, expires_at: datetime) -> bool:
    """running/retry_wait -> running with a new lease and the next fencing token."""
    taken_over = bool(task.lease_owner)
    # Its first step's first claim: the admission record's started_at (a cheap test, so later steps write nothing;
    # leases' one-statement claim records it the same way).
    first = task.current_step == 0 and task.attempts == 0 and not taken_over and task.status == S.RUNNING
    events = []
    if taken_over:
        events.append(NewEvent("recovered", {"step": task.current_step}))
    if task.status == S.RETRY_WAIT:
        events.append(NewEvent("retrying", {"retries": task.retries}))
    won = _move(
        task,
        S.RUNNING,
        allowed_from=CLAIMABLE,
        now=now,
        guard=_lease_free(now) & Q(next_run_at__lte=now),
        fields={
            "lease_owner": owner,
            "lease_expires_at": expires_at,
            "heartbeat_at": now,
            "fencing_token": task.fencing_token + 1,
            "attempts": task.attempts + 1,
            "waiting_reason": "",
        },
        events=events,
    )
    if won and first:
        admission_records.started(task, now=now)
    return won


def commit_step(
    task: Task, *, token: int, now: datetime, keep_lease: bool, events: list[NewEvent], result: Any = None,
    due_at: datetime | None = None, tracking_degraded: bool | None = None, step_done: bool = True,
    guard: Q | None = None, checkpoint: Checkpoint | None = None, alone: bool = False,
) -> bool:
    """running -> running: a step's checkpoint is committed; the next step is due now (or at `due_at`,
    a remote job's next poll). `step_done=False`: a poll that changed nothing, so no checkpoint was
    written and no step is counted. `tracking_degraded` sets or clears the remote-tracking flag.
    `guard`: a further condition on the row (NO_STOP_REQUESTED). `checkpoint`: the step's, written by
    the same statement as the move (when it wins). `alone`: that statement commits by itself (commits_alone)."""
    fields: dict[str, Any] = {
        "current_step": task.current_step + (1 if step_done else 0),
        "attempts": 0,
        "last_progress_at": now,
        "next_run_at": due_at or now,
        "stalled_at": None,
    }
    if not keep_lease:
        fields.update(_released())
    if result is not None:
        fields.update(result=result, result_version=task.result_version + 1)
    return _stay_running(task, token=token, now=now, fields=fields, events=events,
                         tracking_degraded=tracking_degraded, guard=guard, checkpoint=checkpoint, alone=alone)


def _stay_running(task: Task, *, token: int, now: datetime, fields: dict[str, Any], events: list[NewEvent],
                  tracking_degraded: bool | None, guard: Q | None = None, checkpoint: Checkpoint | None = None,
                  alone: bool = False) -> bool:
    """running -> running with `fields`, setting or clearing the remote-tracking flag; a newly degraded
    tracking is news for the task's thread."""
    newly_degraded = bool(tracking_degraded) and not task.tracking_degraded
    assert not (alone and newly_degraded), "news for the thread is written with the move"
    if tracking_degraded is not None:
        fields["tracking_degraded"] = tracking_degraded
    won = _move(task, S.RUNNING, allowed_from={S.RUNNING}, now=now, token=token, fields=fields, events=events,
                guard=guard, checkpoint=checkpoint, alone=alone)
    if won and newly_degraded:
        from tasks import notifications

        notifications.note(task, event="tracking_degraded", now=now)
    return won


def yield_slot(task: Task, *, token: int | None, now: datetime) -> bool:
    """running -> queued at a step boundary: the task gives its slot back to a tenant the weights say
    is owed it (tasks/scheduling.py). It waits for admission again, first in its tenant's queue (the
    oldest), and resumes from its last checkpoint; the freed slot is filled in this transaction. No
    queue deadline: it was admitted once and is owed its slot back, not a queue timeout (its
    wall-time budget still runs). Its attempts are kept (the poison check).

    `token`: the worker holding it, at its step boundary; None: admission, for a task between steps
    that nobody holds."""
    return _move(
        task, S.QUEUED, allowed_from={S.RUNNING}, now=now, token=token,
        guard=NOT_HELD if token is None else None,
        fields={**_released(), "yield_requested_at": None, "next_run_at": None,
                "waiting_reason": "", "queue_deadline_at": None},
        events=[NewEvent("queued", {"reason": "yielded", "step": task.current_step})],
    )


def wait_for_operations(
    task: Task, *, token: int, now: datetime, tool: bool, events: list[NewEvent], step_done: bool = True,
    guard: Q | None = None, checkpoint: Checkpoint | None = None, calls: Sequence[Operation] = (),
    also: tuple[str, list[Any]] | None = None,
) -> bool:
    """running -> waiting_tool (tool calls) or running waiting for the model: no worker, no lease,
    not due until a gateway job has finished every requested operation. `guard`, `checkpoint`: as
    commit_step's. `calls`: the operations, stored by the same statement, which then commits alone
    (calls_commit_alone says when it may) and loses while one of their pools is paused; without them the
    caller stores them in its transaction (operations.request). `also`: with `calls`, one more INSERT of that
    statement's, as _update_reserving_seqs takes it (their gateway kick: kicks.calls_kick_in_move)."""
    fields: dict[str, Any] = {**_released(), "next_run_at": None, "waiting_reason": "tool" if tool else "model",
                              "attempts": 0}
    if step_done:
        fields.update(current_step=task.current_step + 1, last_progress_at=now, stalled_at=None)
    to = S.WAITING_TOOL if tool else S.RUNNING
    return _move(task, to, allowed_from={S.RUNNING}, now=now, token=token, fields=fields,
                 events=_waiting_events(events, tool=tool), guard=guard, checkpoint=checkpoint,
                 alone=bool(calls), calls=calls, also=also)


def calls_commit_alone(events: list[NewEvent], *, tool: bool) -> bool:
    """Whether wait_for_operations may store its calls and commit as one statement (commits_alone)."""
    return commits_alone(_waiting_events(events, tool=tool))


def _waiting_events(events: list[NewEvent], *, tool: bool) -> list[NewEvent]:
    return [*events, NewEvent("waiting_tool", {})] if tool else events


def wait_for_remote(
    task: Task, *, token: int, now: datetime, events: list[NewEvent], step_done: bool = True,
    tracking_degraded: bool | None = None, guard: Q | None = None, checkpoint: Checkpoint | None = None,
) -> bool:
    """running -> running with waiting_reason "tool", no worker, no lease, not due: a remote MCP job
    works while its calls (tools/call, a poll at the server's interval, tasks/update, tasks/cancel)
    are out; the gateway's last result makes it due. `step_done=False`: a poll that learned nothing
    counts no step (it still proves the remote job is followed). `tracking_degraded` sets or clears the flag.
    `guard`, `checkpoint`: as commit_step's."""
    fields: dict[str, Any] = {**_released(), "next_run_at": None, "waiting_reason": "tool", "attempts": 0,
                              "last_progress_at": now, "stalled_at": None}
    if step_done:
        fields["current_step"] = task.current_step + 1
    return _stay_running(task, token=token, now=now, fields=fields, events=events,
                         tracking_degraded=tracking_degraded, guard=guard, checkpoint=checkpoint)


def wait_input(task: Task, *, token: int, now: datetime, question: str, events: list[NewEvent],
               form: dict[str, Any] | None = None) -> bool:
    """running -> waiting_input: the task asks its owner; it holds no slot until answered.
    `form`: the requested schema of a structured answer (None: free text)."""
    return _move(
        task, S.WAITING_INPUT, allowed_from={S.RUNNING}, now=now, token=token,
        fields={**_released(), "next_run_at": None, "question": question[:4000],
                "question_form": form, "answer": "", "answer_data": None,
                "current_step": task.current_step + 1, "last_progress_at": now, "attempts": 0,
                "waiting_reason": "input", "tracking_degraded": False},
        events=[*events, NewEvent("input_required", {"question": question[:4000]})],
    )


def answer(task: Task, *, now: datetime, text: str, data: dict[str, Any] | None = None) -> bool:
    """waiting_input -> queued with the owner's answer (`data`: a structured one, checked against
    the question's form by the caller); admission gives it a slot again."""
    return _move(task, S.QUEUED, allowed_from={S.WAITING_INPUT}, now=now,
                 fields={"answer": text[:10000], "answer_data": data, "waiting_reason": "", "next_run_at": None},
                 events=[NewEvent("input_received", {})])


def withdraw_question(task: Task, *, now: datetime) -> bool:
    """waiting_input -> queued without an answer: the remote task the question came from moved on
    (answered elsewhere, expired, cancelled), as a watch call saw; the next step reads that call."""
    return _move(task, S.QUEUED, allowed_from={S.WAITING_INPUT}, now=now,
                 fields={"question": "", "question_form": None, "answer": "", "answer_data": None,
                         "waiting_reason": "", "next_run_at": None},
                 events=[NewEvent("question_withdrawn", {})]) and _told(task, "question_withdrawn", now=now)


def _told(task: Task, event: str, *, now: datetime) -> bool:
    """After a won move: an event worth telling the task's thread (DESIGN §7)."""
    from tasks import notifications

    notifications.note(task, event=event, now=now)
    return True


def operations_done(task: Task, *, now: datetime) -> bool:
    """waiting_tool/running-for-the-model -> running: the next step is due now."""
    _check_waiting_for_calls(task)
    events = [NewEvent("tool_results_ready", {})] if task.status == S.WAITING_TOOL else []
    return _move(task, S.RUNNING, allowed_from={S.WAITING_TOOL, S.RUNNING}, now=now, guard=_CALLS_OUT,
                 fields=_calls_done(now), events=events)


def operations_done_many(tasks: list[Task], *, now: datetime) -> list[Task]:
    """operations_done for the tasks whose last call of a step a gateway batch recorded, each moved as it would
    move it; returns those moved. Those running while they wait for the model or a tool write no event: one
    UPDATE moves them all (a wave of model answers, a step each). A task waiting for tools alone."""
    for task in tasks:
        _check_waiting_for_calls(task)
    running = [task for task in tasks if task.status == S.RUNNING]
    moved = _move_quietly(running, S.RUNNING, now=now, guard=_CALLS_OUT, fields=_calls_done(now))
    waiting = [task for task in tasks if task.status == S.WAITING_TOOL]
    if connection.vendor == "postgresql":
        # One statement for them all too, each writing its event (on SQLite, one transition each).
        told = _move_telling_each(waiting, S.RUNNING, NewEvent("tool_results_ready", {}), now=now, guard=_CALLS_OUT,
                                  fields=_calls_done(now))
    else:
        told = [task for task in waiting if operations_done(task, now=now)]
    return [*moved, *told]


_CALLS_OUT = NOT_HELD & Q(next_run_at__isnull=True)  # waiting for its calls, not yet made due


def _check_waiting_for_calls(task: Task) -> None:
    """A running task is moved on by its calls only while it waits for them, never in the middle of a step."""
    if task.status == S.RUNNING and task.waiting_reason not in ("model", "tool"):
        raise InvalidTransition(task.public_id, task.status, "operations_done")


def _calls_done(now: datetime) -> dict[str, Any]:
    return {"next_run_at": now, "waiting_reason": "", "last_progress_at": now}


def _move_quietly(tasks: list[Task], to: TaskStatus, *, now: datetime, guard: Q, fields: dict[str, Any]) -> list[Task]:
    """_move for many tasks in one UPDATE, for a move that writes no event and has nothing to follow it: no
    slot given back or needed, nobody told, no ending, no question left. Each row moves only if it is still
    as its task was read (status and version), as with _move; returns the tasks moved, changed as their rows."""
    if not tasks:
        return []
    assert to in HOLDS_SLOT and to not in TOLD, f"a move to {to} has consequences"
    assert all(task.status in HOLDS_SLOT for task in tasks), "a move that needs a slot has consequences"
    values = {**fields, "status": to, "updated_at": now}
    if connection.vendor == "postgresql":
        # Written out (at every batch of calls recorded): the ORM built the OR of the tasks as read at each.
        sql, params = _update_as_read(tasks, values, guard, seq=False)
        return _as_moved(tasks, {row[0] for row in prepared.fetchall(sql, params)}, values)
    as_read = Q()
    for task in tasks:
        as_read |= Q(pk=task.pk, status=task.status, version=task.version)
    # The primary keys apart as well: the OR alone, planned over the task table's many indexes, may scan one of them.
    query = Task.objects.filter(as_read, pk__in=[task.pk for task in tasks]).filter(guard).query.chain(UpdateQuery)
    query.add_update_values({**values, "version": F("version") + 1})  # none sealed: the tasks' tenants may differ
    sql, params = query.get_compiler(connection=connection).as_sql()
    with connection.cursor() as cursor:
        cursor.execute(f"{sql} RETURNING {connection.ops.quote_name(Task._meta.pk.column)}", params)
        won = {row[0] for row in cursor.fetchall()}
    return _as_moved(tasks, won, values)


def _update_as_read(tasks: list[Task], values: dict[str, Any], guard: Q, *, seq: bool) -> tuple[str, list[Any]]:
    """PostgreSQL: one UPDATE of the rows of `tasks` still as each was read (status and version) and meeting
    `guard`, writing `values` (none sealed: the tasks' tenants may differ) and the version bumped, and the seq
    (one reserved a row) if `seq`. RETURNING each moved row's id and seq."""
    qn = connection.ops.quote_name
    table, last_seq = qn(Task._meta.db_table), qn("last_event_seq")
    written_as = typed_sql.set_items(Task, values)
    assert written_as is not None, f"values the ORM would write as SQL of its own: {values}"
    items, params = written_as
    items += [f"{qn('version')} = {table}.{qn('version')} + 1", *([f"{last_seq} = {last_seq} + 1"] if seq else [])]
    as_read = [Task._meta.pk, Task._meta.get_field("status"), Task._meta.get_field("version")]
    read_as = ", ".join([f"({', '.join(map(typed_sql.typed_param, as_read))})"] * len(tasks))
    params += [value for task in tasks for value in (task.pk, task.status, task.version)]
    guard_sql, guard_params = _guard_sql(guard)
    params += guard_params
    sql = (f"UPDATE {table} SET {', '.join(items)} FROM (VALUES {read_as}) AS r(id, status, version) "
           f"WHERE {table}.{qn('id')} = r.id AND {table}.{qn('status')} = r.status "
           f"AND {table}.{qn('version')} = r.version AND {guard_sql} RETURNING {table}.{qn('id')}, {table}.{last_seq}")
    return sql, params


def _as_moved(tasks: list[Task], won: Collection[int], values: dict[str, Any]) -> list[Task]:
    """The tasks whose rows moved (`won`: their primary keys), changed as their rows: `values`, the version bumped."""
    moved = [task for task in tasks if task.pk in won]
    for task in moved:
        for name, value in values.items():
            setattr(task, name, value)
        task.version += 1
    return moved


def _move_telling_each(tasks: list[Task], to: TaskStatus, event: NewEvent, *, now: datetime, guard: Q,
                       fields: dict[str, Any]) -> list[Task]:
    """_move_quietly for a move that writes one event, `event`, on each task moved (PostgreSQL): one UPDATE,
    which reserves each row's seq, and the events' INSERT, from its RETURNING, in one statement. For a move
    with nothing else to follow, as _move_quietly's; the listeners hear the events and the streams are woken,
    as after _move. Returns the tasks moved, changed as their rows."""
    if not tasks:
        return []
    assert connection.in_atomic_block, "a transition and its event commit together"
    assert to in HOLDS_SLOT and to not in TOLD, f"a move to {to} has consequences"
    assert all(task.status in HOLDS_SLOT for task in tasks), "a move that needs a slot has consequences"
    assert len({task.pk for task in tasks}) == len(tasks), "a task moved twice would write two events on one seq"
    qn = connection.ops.quote_name
    seq = qn("last_event_seq")
    values = {**fields, "status": to, "updated_at": now}
    update, params = _update_as_read(tasks, values, guard, seq=True)
    logged = {task.pk: unsaved(task, [NewEvent(event.kind, dict(event.data))], last=1, status=to, at=now)[0]
              for task in tasks}
    fields_of_event = [field for field in _inserted_fields(TaskEvent) if field.attname != "seq"]
    rows = ", ".join([f"(CAST(%s AS bigint), {', '.join(map(typed_sql.typed_param, fields_of_event))})"] * len(tasks))
    for task in tasks:
        params += [task.pk, *typed_sql.insert_params(TaskEvent, fields_of_event, [logged[task.pk]])]
    columns = [qn(field.column) for field in fields_of_event]
    seq_column = qn(TaskEvent._meta.get_field("seq").column)
    names = [f"e{n}" for n in range(len(columns))]
    sql = (f"WITH moved AS ({update}), "
           f"saved AS (INSERT INTO {qn(TaskEvent._meta.db_table)} ({', '.join(columns)}, {seq_column}) "
           f"SELECT {', '.join(f'e.{name}' for name in names)}, moved.{seq} FROM moved "
           f"JOIN (VALUES {rows}) AS e(task_id, {', '.join(names)}) ON e.task_id = moved.{qn('id')}) "
           f"SELECT {qn('id')}, {seq} FROM moved")
    won = dict(prepared.fetchall(sql, params))  # numbered: a wave's statement has hundreds of parameters
    moved = _as_moved(tasks, won, values)
    for task in moved:
        logged[task.pk].seq = won[task.pk]
        written(task, [logged[task.pk]], last=won[task.pk])
    return moved


def make_due(task: Task, *, now: datetime, reason: str) -> bool:
    """running/retry_wait/waiting_tool (not held, not due) -> running, due now: the liveness repair
    for a task that nothing would ever claim (tasks/liveness.py)."""
    return _move(task, S.RUNNING, allowed_from={S.RUNNING, S.RETRY_WAIT, S.WAITING_TOOL}, now=now,
                 guard=_lease_free(now) & Q(next_run_at__isnull=True),
                 fields={"next_run_at": now, "waiting_reason": "", "lease_owner": "", "lease_expires_at": None},
                 events=[NewEvent("repaired", {"reason": reason})])


def defer(task: Task, *, token: int, now: datetime, until: datetime, reason: str) -> bool:
    """running -> running, released and due later, without spending an attempt."""
    return _move(task, S.RUNNING, allowed_from={S.RUNNING}, now=now, token=token,
                 fields={**_released(), "next_run_at": until, "attempts": 0},
                 events=[NewEvent("deferred", {"reason": reason, "until": until.isoformat()})])


def schedule_retry(
    task: Task, *, token: int, now: datetime, run_at: datetime, error_class: str, message: str
) -> bool:
    """running -> retry_wait: a retryable error; the step runs again at `run_at`."""
    return _move(
        task,
        S.RETRY_WAIT,
        allowed_from={S.RUNNING},
        now=now,
        token=token,
        fields={**_released(), "next_run_at": run_at, "retries": task.retries + 1, "attempts": 0,
                "waiting_reason": "retry"},
        events=[NewEvent("retry_scheduled", {"error_class": error_class, "message": message,
                                             "retry_at": run_at.isoformat(), "retries": task.retries + 1})],
    )


# --- endings ---------------------------------------------------------------------


def succeed(task: Task, *, token: int, now: datetime, result: Any, events: list[NewEvent], guard: Q | None = None,
            checkpoint: Checkpoint | None = None) -> bool:
    """running -> succeeded with `result`. `guard`, `checkpoint`: as commit_step's."""
    return _move(
        task,
        S.SUCCEEDED,
        allowed_from={S.RUNNING},
        now=now,
        token=token,
        guard=guard,
        fields={**_finished(now), "result": result, "result_version": task.result_version + 1,
                "current_step": task.current_step + 1, "last_progress_at": now},
        events=[*events, NewEvent("succeeded", {"result_version": task.result_version + 1})],
        checkpoint=checkpoint,
    )


def finish_partial(
    task: Task, *, now: datetime, result: Any, scope: str, reason: str, token: int | None = None,
    step_done: bool = False,
) -> bool:
    """Stop with a deliverable result of stated scope (budget, or cancel keeping results).
    `step_done`: the caller checkpointed the step that ran out, so it counts (a resume goes on after it)."""
    return _move(
        task,
        S.PARTIAL,
        allowed_from=ACTIVE,
        now=now,
        token=token,
        guard=None if token is not None else _lease_free(now),
        fields={**_finished(now), "result": result, "result_version": task.result_version + 1,
                "fencing_token": task.fencing_token + 1, "current_step": task.current_step + int(step_done)},
        events=[NewEvent("partial", {"scope": scope, "reason": reason, "result_version": task.result_version + 1})],
    )


def fail(
    task: Task, *, now: datetime, error_class: str, message: str, detail: str = "", token: int | None = None,
    result: Any = None, step_done: bool = False,
) -> bool:
    """Any active status -> failed. Without a token, only while nobody holds the lease.
    `result`: what a failed remote tool returned, kept beside the error. `step_done`: as for finish_partial."""
    fields = {**_finished(now), "error_class": error_class, "error_message": message[:2000],
              "error_detail": detail[:10000], "fencing_token": task.fencing_token + 1,
              "current_step": task.current_step + int(step_done)}
    if result is not None:
        fields.update(result=result, result_version=task.result_version + 1)
    return _move(
        task,
        S.FAILED,
        allowed_from=ACTIVE,
        now=now,
        token=token,
        guard=None if token is not None else _lease_free(now),
        fields=fields,
        events=[NewEvent("failed", {"error_class": error_class, "message": message[:500]})],
    )


def cancel(task: Task, *, now: datetime, token: int | None = None, reason: str = "") -> bool:
    """Any active status -> cancelled. Without a token, only while nobody holds the lease;
    the fencing token moves on, so a holder whose lease expired can write nothing more."""
    return _move(
        task,
        S.CANCELLED,
        allowed_from=ACTIVE,
        now=now,
        token=token,
        guard=None if token is not None else _lease_free(now),
        fields={**_finished(now), "error_class": "cancelled", "fencing_token": task.fencing_token + 1},
        events=[NewEvent("cancelled", {"reason": reason or task.cancel_reason})],
    )


def stop_remote(task: Task, *, now: datetime, token: int | None = None) -> bool:
    """Any active status -> running, due now, to cancel the task's remote work before it ends
    (DESIGN §10). Without a token, only while nobody holds the lease; the fencing token moves
    on, so a poll still in flight can write nothing."""
    return _move(
        task,
        S.RUNNING,
        allowed_from=ACTIVE,
        now=now,
        token=token,
        guard=None if token is not None else _lease_free(now),
        fields={**_released(), "next_run_at": now, "waiting_reason": CANCEL_WAIT, "attempts": 0,
                "fencing_token": task.fencing_token + 1},
        events=[NewEvent("cancelling_remote", {})],
    )


def queue_for_cancel(task: Task, *, now: datetime) -> bool:
    """queued, paused, waiting_input or partial -> queued, first in its tenant, to cancel the task's
    remote work once admitted: telling the server takes a running slot like any step, so a task that
    holds none waits for one (stop_remote is for a task that holds its slot). Only while nobody holds
    the lease; the fencing token moves on, so a watch call still in flight can write nothing."""
    return _move(
        task,
        S.QUEUED,
        allowed_from=ACTIVE - HOLDS_SLOT,
        now=now,
        guard=_lease_free(now),
        fields={**_released(), "next_run_at": None, "waiting_reason": CANCEL_WAIT, "attempts": 0,
                "fencing_token": task.fencing_token + 1},
        events=[NewEvent("cancelling_remote", {})],
    )


# --- pause, resume, requests -----------------------------------------------------


def pause(task: Task, *, now: datetime, token: int | None = None) -> bool:
    """Stop at a safe point with a complete checkpoint; holds no slot until resumed."""
    return _move(
        task,
        S.PAUSED,
        allowed_from={S.QUEUED, S.RUNNING, S.RETRY_WAIT, S.WAITING_INPUT, S.WAITING_TOOL},
        now=now,
        token=token,
        guard=None if token is not None else _lease_free(now),
        fields={**_released(), "next_run_at": None, "fencing_token": task.fencing_token + 1,
                "waiting_reason": ""},
        events=[NewEvent("paused", {"reason": task.pause_reason})],
    )


def requeue(task: Task, *, now: datetime, queue_deadline_at: datetime, budget: dict[str, Any] | None = None,
            reason: str) -> bool:
    """paused/partial -> queued: wait for admission again, from the last checkpoint, with a queue deadline
    counted from now (the one set at submission bounded a wait that is over)."""
    fields: dict[str, Any] = {
        "queue_deadline_at": queue_deadline_at,
        "pause_requested_at": None, "pause_requested_by": None, "pause_reason": "",
        "cancel_requested_at": None, "cancel_requested_by": None, "cancel_reason": "",
        "cancel_keep_results": False, "finished_at": None, "next_run_at": None, "attempts": 0,
    }
    if budget is not None:
        fields["budget"] = budget
    return _move(task, S.QUEUED, allowed_from={S.PAUSED, S.PARTIAL}, now=now, fields=fields,
                 events=[NewEvent("queued", {"reason": reason})])


def requeue_failed(task: Task, *, now: datetime, queue_deadline_at: datetime) -> bool:
    """failed -> queued, keeping current_step so the next claim resumes from the last checkpoint.
    The error columns are cleared (the `failed` event and the audit entry keep them): a queued
    task that still showed an error class would read as failed in the API and the admin."""
    return _move(
        task, S.QUEUED, allowed_from={S.FAILED}, now=now,
        guard=Q(lease_owner=""),
        fields={"error_class": "", "error_message": "", "error_detail": "", "finished_at": None, "started_at": None,
                "retries": 0, "attempts": 0, "next_run_at": None, "stalled_at": None,
                "queue_deadline_at": queue_deadline_at,
                "cancel_requested_at": None, "cancel_requested_by": None, "cancel_reason": "",
                "cancel_keep_results": False, "pause_requested_at": None, "pause_requested_by": None,
                "pause_reason": ""},
        events=[NewEvent("queued", {"reason": "requeued"})],
    )


def release_lease(task: Task, *, now: datetime) -> bool:
    """running (held) -> running (free, due now), fenced on the token this caller read."""
    return _move(
        task, S.RUNNING, allowed_from={S.RUNNING}, now=now, token=task.fencing_token,
        guard=~Q(lease_owner=""),
        fields={"lease_owner": "", "lease_expires_at": None, "fencing_token": task.fencing_token + 1,
                "next_run_at": now, "waiting_reason": ""},
        events=[NewEvent("lease_released", {})],
    )


def mark_cancel_requested(task: Task, *, now: datetime, by_id: int | None, reason: str, keep_results: bool) -> bool:
    """Persist a cancel request first; whoever holds the task acts on it at its next safe point."""
    if task.status in TERMINAL:
        raise InvalidTransition(task.public_id, task.status, "cancel_requested")
    rows = Task.objects.filter(pk=task.pk, version=task.version, cancel_requested_at__isnull=True)
    fields = {"cancel_requested_at": now, "cancel_requested_by_id": by_id, "cancel_reason": reason[:500],
              "cancel_keep_results": keep_results, "version": task.version + 1, "updated_at": now}
    if rows.update(**fields) != 1:
        return False
    for name, value in fields.items():
        setattr(task, name, value)
    append(task, [NewEvent("cancel_requested", {"reason": reason[:500], "keep_results": keep_results})],
           status=task.status, at=now)
    return True


def mark_pause_requested(task: Task, *, now: datetime, by_id: int | None, reason: str) -> bool:
    if task.status in TERMINAL:
        raise InvalidTransition(task.public_id, task.status, "pause_requested")
    rows = Task.objects.filter(pk=task.pk, version=task.version, pause_requested_at__isnull=True)
    fields = {"pause_requested_at": now, "pause_requested_by_id": by_id, "pause_reason": reason[:500],
              "version": task.version + 1, "updated_at": now}
    if rows.update(**fields) != 1:
        return False
    for name, value in fields.items():
        setattr(task, name, value)
    append(task, [NewEvent("pause_requested", {"reason": reason[:500]})], status=task.status, at=now)
    return True


def ask_to_yield(task: Task, *, now: datetime) -> bool:
    """Ask a running task to give its slot back at its next step boundary (scheduling.take_a_slot_back).

    No version bump and no event: the holder's fenced writes stay valid, its next step start or
    commit sees the request (NO_STOP_REQUESTED), and the `queued` event it then appends tells."""
    won = Task.objects.filter(pk=task.pk, status=S.RUNNING, yield_requested_at__isnull=True).update(
        yield_requested_at=now) == 1
    if won:
        task.yield_requested_at = now
    return won
