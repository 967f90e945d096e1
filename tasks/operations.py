"""Calls that steps request, executed by gateway jobs: model calls, tool calls and MCP requests.

A step never waits on the network: it asks for Operations and the task waits, holding no
worker (waiting_tool; running with waiting_reason "model"; or, while a remote MCP job works,
running with waiting_reason "tool"). A gateway job claims due operations in batches, under
each pool's concurrency cap shared by every process (model, tool, and mcp per server), runs
them concurrently on one event loop, records each result on its row, and when a task's last
operation of a step is done, makes the next step due and kicks it. An operation may be due
later (`not_before`, a remote job's next poll): the step that requested it kicked the gateway
for then, and the sweeper finds it if that kick is lost.

A finished operation is never executed again. One whose gateway job died is claimed again
when its lease expires, unless it must never run twice (`has_side_effects`: a tools/call):
that one fails as "may or may not have started", and its task decides what follows. Calls
that stop a remote job (tasks/cancel) run whatever became of their task: an abandon is
requested in the very transaction that ends the task, and a remote job whose tools/call
finished after its task had ended is stopped the same way.

On PostgreSQL one gateway job claims at a time per turn (a session advisory lock), and a
database has LONGHAUL_GATEWAY_TURNS of them, one by default: one event loop keeps hundreds of
calls in flight, and more split the calls' CPU over processes at the cost of the steps beside
them. A job that finds every turn taken returns at once; a holder kicks again on its way out if
work is left, so nothing waits for the sweeper while a holder lives. Jobs holding turns at once
all hear the steps' commits and claim in shares (SHARE_AT_MOST), one after another at the
claims' lock, so the limits hold however many claim and a wave of calls spreads over their
processes. A worker runs the job's event loop on a thread beside its own jobs
(tasks/gateway_thread.py), so the calls out hold no worker: the steps their results make due
have every worker process of the machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
import traceback
import zlib
from collections import Counter
from collections.abc import Callable, Iterable, Sequence, Sized
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, TypeVar

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import close_old_connections, connection, connections, transaction
from django.db.models import BooleanField, Case, Count, F, Min, OuterRef, Q, QuerySet, Subquery, Value, When, Window
from django.db.models.functions import RowNumber
from django.db.models.sql.subqueries import InsertQuery

from tasks import (
    broker,
    clock,
    drain,
    events,
    kicks,
    leases,
    pools,
    prepared,
    requested,
    sealed,
    transitions,
    typed_sql,
)
from tasks.budgets import Budget
from tasks.compiled import compiled_once
from tasks.context import digest
from tasks.descriptors import calls_at_most
from tasks.drain import draining
from tasks.drivers import OpRequest
from tasks.errors import InternalError, InvalidInput, RateLimited, StepError, StepTimeout
from tasks.events import NewEvent
from tasks.models import Checkpoint, Operation, Pool, Task
from tasks.statuses import TERMINAL, OperationStatus, TaskStatus

if TYPE_CHECKING:
    from tasks.mcp.client import ServerConfig

log = logging.getLogger(__name__)
T = TypeVar("T")
KINDS = ("model", "tool", "mcp")
FINISHED = (OperationStatus.SUCCEEDED, OperationStatus.FAILED)
GATEWAY = Operation.Mode.GATEWAY
STOPS_REMOTE_WORK = "tasks/cancel"  # an MCP call that runs whatever became of its task
WATCH_PREFIX = "w"  # task:step:w<n>, the calls that watch a remote task while its owner is asked
WATCH_AGAIN_AFTER = timedelta(seconds=60)  # a question that still stands is looked at again no sooner
WATCHDOG_MARGIN = timedelta(milliseconds=500)
CANDIDATES_AT_MOST = 5_000  # due calls one claim of one pool reads
WATCHDOG_STEP = timedelta(seconds=2)
BATCH_AT_MOST = 50  # outcomes recorded in one transaction
WRITERS = 2  # a gateway job's batches of outcomes written at once (Recorder)
# With more than one turn, the calls one claim of a job takes at most: the jobs that heard the same commit wait at
# the claims' lock, and take the next share in turn, so a wave of calls is spread over their processes.
SHARE_AT_MOST = 50
LOST = ("the gateway job running this call stopped before it answered, so the call may or may not have started; "
        "it is not run again")


@dataclass(frozen=True)
class OpOutcome:
    """What a step sees of an operation the previous step requested."""

    name: str
    args: dict[str, Any]
    ok: bool
    result: Any
    error_class: str
    error_message: str
    usage: dict[str, Any]
    finished: bool = True


# --- the step side -------------------------------------------------------------


def request(task: Task, *, token: int, requests: list[OpRequest], now: datetime, prefix: str = "r",
            step: int | None = None, new_step: bool = False) -> datetime:
    """Inside the step's commit: store the requested operations as pending rows. Returns when the
    first is due, for the gateway kick.

    Keys are task:step:r<n>, `step` being the step that asks (by default the task's current one);
    a step that counted for nothing (a quiet poll) adds its calls to the step before, after the
    ones there. Calls that belong to the task's end rather than to a step (an abandon) are
    task:step:a<n>, which no step reads as its outcomes.

    `new_step`: the calls are the first of a step this commit counts, so none is numbered yet (a task's
    current_step only grows); the keys' uniqueness would refuse a second r0 all the same."""
    step = task.current_step if step is None else step
    first = 0 if new_step else Operation.objects.filter(
        task_id=task.pk, step=step, key__startswith=f"{task.pk}:{step}:{prefix}").count()
    rows = new_calls(task, token=token, requests=requests, now=now, step=step, first=first, prefix=prefix)
    keys = {op.pool for op in rows}
    paused = _store_reading_pauses(rows, pools.paused_among(keys, now=now))
    due = max(now, min(r.not_before or now for r in requests))
    if paused:
        # The task waits on a pool a provider paused: say so now, and run its calls when the pause ends.
        events.append(task, [NewEvent(pools.PAUSED, {"pool": pools.label(key), "kind": pools.kind_of(key),
                                                     "until": until.isoformat(), "reason": "rate_limited"})
                             for key, until in sorted(paused.items())], status=task.status, at=now)
        if set(paused) == keys:  # a call in a pool that is not paused goes at once
            due = max(due, min(paused.values()))
    return due


def new_calls(task: Task, *, token: int, requests: Sequence[OpRequest], now: datetime, step: int, first: int = 0,
              prefix: str = "r") -> list[Operation]:
    """The pending rows of the calls a step asks for, unsaved, numbered from `first` (keys as request() says)."""
    return [
        Operation(task_id=task.pk, key=f"{task.pk}:{step}:{prefix}{n}", step=step, n=n, kind=r.kind, name=r.name,
                  pool=pools.key_of(r.kind, r.name, r.args), mode=GATEWAY, args=r.args, args_digest=digest(r.args),
                  status=OperationStatus.PENDING, fencing_token=token, attempts=0, has_side_effects=r.once,
                  not_before=r.not_before, created_at=now)
        for n, r in enumerate(requests, start=first)
    ]


def _store_reading_pauses(rows: list[Operation], pauses: QuerySet[Pool, tuple[str, datetime]]) -> dict[str, datetime]:
    """Insert the operations and read their pools' pauses (`pauses`, a query of (key, paused_until)); on
    PostgreSQL in one statement, the INSERT a data-modifying WITH of the read (it runs whether or not the read
    looks at it), where they were two round trips. The INSERT is Django's own, its values sealed as
    bulk_create seals them."""
    if connection.vendor != "postgresql":
        Operation.objects.bulk_create(rows)
        return dict(pauses)
    fields = [field for field in Operation._meta.concrete_fields if not field.primary_key]
    query = InsertQuery(Operation)
    query.insert_values(fields, rows)
    [(insert, inserted)] = query.get_compiler(connection=connection).as_sql()
    select, selected = pauses.query.sql_with_params()
    with connection.cursor() as cursor:
        cursor.execute(f"WITH stored AS ({insert}) {select}", [*inserted, *selected])
        return dict(cursor.fetchall())


def request_abandon(task: Task, *, now: datetime) -> bool:
    """Inside the transaction that ends a task (or finds it ended): ask its remote work to stop, once.

    A worker fenced out never gets here (its end raised LeaseLost first), so it cannot stop
    its successor's remote job."""
    from tasks.drivers import get_driver, remote_cancelling

    try:
        remote = remote_cancelling(get_driver(task.kind))
    except InvalidInput:
        return False
    if remote is None or Operation.objects.filter(task_id=task.pk, key__contains=":a").exists():
        return False
    checkpoint = Checkpoint.objects.filter(task_id=task.pk).order_by("-step").first()
    requests = remote.abandon(task, checkpoint.state if checkpoint else None)
    if not requests:
        return False
    due = request(task, token=task.fencing_token, requests=requests, now=now, prefix="a")
    kicks.kick_calls(task.pk, at=due)
    return True


def request_watch(task: Task, *, token: int, watch: OpRequest, now: datetime, step: int) -> datetime:
    """Inside the commit of a step that asked its owner (`step`): the call that watches the remote
    task meanwhile (task:step:w<n>; its outcome is the next step's, like the step's other calls).
    Returns when it is due, for the gateway kick."""
    return request(task, token=token, requests=[watch], now=now, prefix=WATCH_PREFIX, step=step)


def is_watch(key: str) -> bool:
    return f":{WATCH_PREFIX}" in key


def _of_step(task_id: int, step: int):
    """The operations `step` requested (an abandon belongs to the task's end, not to a step)."""
    return (Operation.objects.filter(task_id=task_id, step=step, mode=GATEWAY)
            .exclude(key__startswith=f"{task_id}:{step}:a"))


def _awaited_of_step(task_id: int, step: int):
    """The operations of `step` that its task waits for: not a watch, which runs only while the owner
    is asked, and which the next step reads as it finds it."""
    return _of_step(task_id, step).exclude(key__startswith=f"{task_id}:{step}:{WATCH_PREFIX}")


def outcomes(task_id: int, step: int) -> list[OpOutcome]:
    """The operations requested by `step`, in request order."""
    return outcomes_and_wait(task_id, step)[0]


def outcomes_and_wait(task_id: int, step: int) -> tuple[list[OpOutcome], bool]:
    """outcomes() and unfinished() in one read: what a step resumed after its calls needs first. (On
    PostgreSQL the statement that claims the task reads the same rows: leases.Resume.calls.)"""
    return read_outcomes(list(_of_step(task_id, step).order_by("n", "id").only("task_id", *leases.CALL_FIELDS)))


def read_outcomes(calls: Sequence[Operation]) -> tuple[list[OpOutcome], bool]:
    """The outcomes of a step's calls (in request order, leases.CALL_FIELDS loaded), and whether the task
    still waits for one of them."""
    found = [
        OpOutcome(name=op.name, args=op.args, ok=op.status == OperationStatus.SUCCEEDED, result=op.result,
                  error_class=op.error_class, error_message=op.error_message, usage=op.usage,
                  finished=op.status in FINISHED)
        for op in calls
    ]
    return found, any(op.status not in FINISHED and _awaited(op.key) for op in calls)


def unfinished(task_id: int, step: int) -> bool:
    """Whether the task still waits for a call of `step`."""
    return _awaited_of_step(task_id, step).exclude(status__in=FINISHED).exists()


def waits_on(task_id: int, step: int, kind: str) -> bool:
    """Whether an unfinished operation of `step` is of this pool."""
    return _awaited_of_step(task_id, step).filter(kind=kind).exclude(status__in=FINISHED).exists()


def waits_on_tool(task_id: int, step: int) -> bool:
    return waits_on(task_id, step, "tool")


def first_due(task_id: int, step: int, now: datetime) -> datetime:
    """When the first unfinished operation of `step` is due, for a gateway kick."""
    dues = list(_awaited_of_step(task_id, step).exclude(status__in=FINISHED).values_list("not_before", flat=True))
    return now if not dues or None in dues else max(now, min(dues))


# --- the gateway side ----------------------------------------------------------


# As many gateway jobs of a database claim at a time as it has turns (LONGHAUL_GATEWAY_TURNS): the key of the first
# turn's session advisory lock (broker.gateway_turn_keys).
GATEWAY_TURN_KEY = broker.GATEWAY_TURN_KEY
CLAIMS_KEY = zlib.crc32(b"longhaul-gateway-claims")  # the transaction advisory lock every claim takes


def take_gateway_turn() -> int | None:
    """Try to become a job that claims operations: the key of the turn taken, or None when every turn is
    held by another job.

    A session lock, not a transaction's: it is held across the many short claim
    transactions of one job, and PostgreSQL drops it if the job's process dies.
    SQLite (the embedded mode) has no advisory locks; its gateway jobs share the work (each "takes" the first
    turn's key, and holds nothing).
    The job that takes the last turn free withdraws the gateway kicks due now: it and the others claim their
    calls next, and each would only run a job that is refused a turn (kicks.withdraw_gateway_kicks).
    """
    # The caller's connection (a gateway job's own, operations.pump) may have gone bad since its last use: drop it.
    close_old_connections()
    if connection.vendor != "postgresql":
        return GATEWAY_TURN_KEY
    turns = broker.gateway_turn_keys()
    with connection.cursor() as cursor:
        for key in turns:
            cursor.execute("SELECT pg_try_advisory_lock(%s)", [key])
            if cursor.fetchone()[0]:
                break
        else:
            return None
        # The keys before this one were held; those after it may be free. (With one turn: none is.)
        a_turn_free = False
        if key != turns[-1]:
            cursor.execute(f"SELECT {broker.TURN_FREE}", [turns])
            [a_turn_free] = cursor.fetchone()
    if not a_turn_free:
        kicks.withdraw_gateway_kicks(clock.now())
    return key


def end_gateway_turn(key: int) -> None:
    """Give the turn of `key` back; then wait for the step statements that saw every turn held, so that the look
    that follows (kick_if_claimable) sees their calls: such a statement kicked no job for them
    (kicks.calls_kick_in_move)."""
    if connection.vendor != "postgresql":
        return
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_advisory_unlock(%s)", [key])
        cursor.execute("SELECT pg_advisory_lock(%s)", [broker.GATEWAY_GATE_KEY])
        cursor.execute("SELECT pg_advisory_unlock(%s)", [broker.GATEWAY_GATE_KEY])


def waiting_task() -> Q:
    """Operations of the step their task waits for (a cancelled or paused task's calls, or those of
    a step it has moved past, are not run)."""
    waiting = Q(task__status=TaskStatus.WAITING_TOOL) | Q(task__status=TaskStatus.RUNNING,
                                                          task__waiting_reason__in=("model", "tool"))
    return waiting & Q(step__gte=F("task__current_step") - 1)


def watching_task() -> Q:
    """Watch calls of a task that still waits for its owner's answer to the step that asked."""
    return (Q(task__status=TaskStatus.WAITING_INPUT, key__contains=f":{WATCH_PREFIX}")
            & Q(step=F("task__current_step") - 1))


def _claimable() -> Case:
    """Calls a gateway job may run, by what their task waits for.

    One CASE rather than a bare OR: an OR whose arms test both the call and its task makes PostgreSQL's
    planner try index paths for each arm over the task table's many indexes, about 5 ms of planning a
    statement on every claim and first look (0.3 ms as a CASE). As a CASE it is a filter on the task found
    through its primary key, the plan both ways."""
    return Case(When(waiting_task() | watching_task() | Q(kind="mcp", name=STOPS_REMOTE_WORK), then=Value(True)),
                default=Value(False), output_field=BooleanField())


def _due(now: datetime) -> Q:
    """Pending and due, or started by a job whose lease ran out (it died)."""
    return (Q(status=OperationStatus.PENDING) & (Q(not_before__isnull=True) | Q(not_before__lte=now))
            | Q(status=OperationStatus.STARTED, lease_expires_at__lt=now))


def _due_apart(now: datetime) -> tuple[Q, Q, Q]:
    """_due's three cases apart, each an index condition of its own (operation_due_now_idx, operation_due_idx,
    operation_pool_inflight_idx). _due keeps its own form: "pending" factored out of the OR is the one the
    claims' plans were measured with."""
    return (Q(status=OperationStatus.PENDING, not_before__isnull=True),
            Q(status=OperationStatus.PENDING, not_before__lte=now),
            Q(status=OperationStatus.STARTED, lease_expires_at__lt=now))


def _runnable(pool: str, now: datetime):
    """Due operations of a pool that a gateway job may run (one that must not run twice is never run again)."""
    return (Operation.objects.filter(_due(now), _claimable(), pool=pool, mode=GATEWAY)
            .exclude(status=OperationStatus.STARTED, has_side_effects=True))


def _live(now: datetime):
    """Calls out now: started under a lease that has not run out (operation_pool_inflight_idx)."""
    return Operation.objects.filter(status=OperationStatus.STARTED, mode=GATEWAY, lease_expires_at__gte=now)


@compiled_once
def _oldest_due_by_pool(*, now: datetime) -> QuerySet:
    """Each pool's oldest call a gateway job may run now, for each of _due's cases (a pool may be named thrice)."""
    # _due's cases apart, each read off an index: as one OR the planner reads every call not yet finished, ten
    # thousand while as many remote jobs wait for their next poll, on every sweep.
    first, *others = [Operation.objects.filter(due, _claimable(), mode=GATEWAY).order_by()
                      .values("pool").annotate(oldest=Min("id")).values_list("pool", "oldest")
                      for due in _due_apart(now)]
    return first.union(*others)


def _pools_with_due_work(now: datetime) -> list[str]:
    """Pools with calls a gateway job may run now, the pool whose oldest such call was asked for first in front."""
    oldest: dict[str, int] = {}
    for pool, op_id in _oldest_due_by_pool(now=now):
        oldest[pool] = min(op_id, oldest.get(pool, op_id))
    return sorted(oldest, key=lambda pool: (oldest[pool], pool))


def _at_task_cap(now: datetime, cap: int):
    """Tasks with `cap` calls out or more (LONGHAUL_TASK_CALLS_IN_FLIGHT: as many as one task may have)."""
    return _live(now).order_by().values("task_id").annotate(n=Count("*")).filter(n__gte=cap).values("task_id")


@compiled_once
def _ranked_candidates(*, pool: str, now: datetime, limit: int, cap: int) -> QuerySet:
    """_candidates' rows: (call, task, tenant, the tenant's weight)."""
    ranked = (_runnable(pool, now).exclude(task_id__in=_at_task_cap(now, cap)).annotate(
        nth=Window(RowNumber(), partition_by=[F("task_id")], order_by=F("id").asc()),
        # Per tenant too: a tenant with a thousand due calls must not hide another tenant's one.
        nth_of_tenant=Window(RowNumber(), partition_by=[F("task__tenant_id")], order_by=F("id").asc())))
    return (ranked.filter(nth__lte=cap, nth_of_tenant__lte=limit).order_by("id")
            .values_list("pk", "task_id", "task__tenant_id", "task__tenant__weight")[:CANDIDATES_AT_MOST])


def _candidates(pool: str, now: datetime, *, limit: int) -> list[pools.Candidate]:
    """The pool's due calls a claim may start, oldest first: at most `limit` from any one tenant and a
    task's cap from any one task, none from a task already at it (so a task's or a tenant's thousand calls
    cannot hide another's one)."""
    rows = _ranked_candidates(pool=pool, now=now, limit=limit, cap=settings.LONGHAUL_TASK_CALLS_IN_FLIGHT)
    return [pools.Candidate(*row) for row in rows]


def _choose(pool: str, room: int, now: datetime, *, tenant_busy: Counter[int]) -> list[pools.Candidate]:
    """Up to `room` of the pool's due calls, shared among tenants by weight and among tasks by their cap.
    `tenant_busy`: the pool's calls out per tenant (_busy_by_tenant), consumed as calls are picked."""
    candidates = _candidates(pool, now, limit=room)
    if not candidates:
        return []
    task_ids = {c.task_id for c in candidates}
    out_per_task = Counter(dict(_live(now).filter(task_id__in=task_ids).order_by().values("task_id")
                                .annotate(n=Count("*")).values_list("task_id", "n")))
    weights = {c.tenant_id: c.weight for c in candidates}
    task_room = {t: settings.LONGHAUL_TASK_CALLS_IN_FLIGHT - out_per_task[t] for t in task_ids}
    return pools.choose(candidates, room=room, tenant_busy=tenant_busy, task_room=task_room, weights=weights)


@compiled_once
def _out_by_tenant(*, pool: str, now: datetime) -> QuerySet:
    """(tenant, calls out) of the pool. Each call's tenant through its task's primary key: joined by tenant
    instead, a planner without statistics nests a loop over every task of the tenant for each call out
    (milliseconds with a few hundred calls out)."""
    tenant_of = Subquery(Task.objects.filter(pk=OuterRef("task_id")).values("tenant_id"))
    return (_live(now).filter(pool=pool).order_by().values(tenant=tenant_of)
            .annotate(n=Count("*")).values_list("tenant", "n"))


def _busy_by_tenant(pool: str, now: datetime) -> Counter[int]:
    """The pool's calls out now, per tenant (every tenant's: choose reads the candidates' only); together,
    all the pool's calls out."""
    return Counter(dict(_out_by_tenant(pool=pool, now=now)))


def _room(pool: Pool, now: datetime, *, in_flight: int | None = None) -> int:
    """Calls the pool may start now; `in_flight`, its calls out, when the caller has counted them."""
    if in_flight is None:
        in_flight = _live(now).filter(pool=pool.key).count()
    return pools.room(pool, in_flight=in_flight, now=now)


def claimable_exists(now: datetime) -> bool:
    """Due operations that a gateway job could claim now: their pool has room and their task is under its cap."""
    for key in _pools_with_due_work(now):
        with transaction.atomic():
            if _room(pools.state(key, now=now), now) > 0 and _candidates(key, now, limit=1):
                return True
    return False


def rate_held_until(now: datetime) -> datetime | None:
    """The soonest moment a pool held back by its rate or a pause, with calls due, may start one again."""
    soonest = None
    for key in _pools_with_due_work(now):
        with transaction.atomic():
            at = pools.next_allowance_at(pools.state(key, now=now), now=now)
        if at is not None and (soonest is None or at < soonest):
            soonest = at
    return soonest


def kick_if_claimable() -> bool:
    """On a gateway job's way out: hand the work left over to the next job.

    Jobs refused every turn while this one held one returned without claiming; their
    operations were committed before they were refused, so this check sees them.
    A pool that is full waits for the jobs running its calls, which look again when
    they end, so this never kicks in a loop; one held back by its rate or a pause gets a
    kick for when it may start again.
    """
    now = clock.now()
    if not claimable_exists(now):
        held = rate_held_until(now)
        if held is not None:
            kicks.kick("operations", 0, at=held)
        return False
    kicks.kick("operations", 0)
    return True


def _lock_claims() -> None:
    """Serialize claims across processes, so that the limits hold everywhere: a pool's (its slots, its rate, its
    tenants' shares), and a task's over all pools (LONGHAUL_TASK_CALLS_IN_FLIGHT). So one lock for every pool's
    claims, not one per pool: jobs holding different turns (LONGHAUL_GATEWAY_TURNS) claiming two pools at once
    would each count a task's calls out without the other's, and together exceed its cap. A claim is one short
    transaction; the calls it starts run outside it."""
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_xact_lock(%s)", [CLAIMS_KEY])
    # SQLite: the IMMEDIATE transaction already holds the database's write lock.


def claim_batch(*, owner: str, limit: int, now: datetime) -> list[Operation]:
    """Claim up to `limit` due operations of every pool, each pool within its room (slots, rate, pause).

    `limit` (the job's own room) is shared among the pools with due calls, the pool whose oldest call was
    asked for first in front: each takes at most its share of what is left, and a pool that took all of its
    share may take more in another pass over what the others left. So a backlog in one pool (two hundred
    model calls) cannot take every slot a job frees while another pool's calls (a search) wait."""
    return _claim(owner=owner, limit=limit, now=now)[0]


def _claim(*, owner: str, limit: int, now: datetime) -> tuple[list[Operation], bool]:
    """claim_batch, and whether any call was due before it claimed (if none was, a call that ends frees
    nothing to claim: only a call requested next is)."""
    settle_lost_calls(now=now)
    claimed: list[Operation] = []
    keys = _pools_with_due_work(now)
    anything_due = bool(keys)
    if not keys:
        return claimed, anything_due
    # Every pool's part in one transaction: one that fails part-way (a timeout, the connection lost) starts
    # nothing. Committed pool by pool, the calls of the pools before were left started under a job that never
    # ran them, until their lease ran out; one that must not run twice was then failed as lost (settle_lost_calls).
    with transaction.atomic():
        _lock_claims()
        while keys and len(claimed) < limit:
            may_have_more = []
            for position, key in enumerate(keys):
                left = limit - len(claimed)
                if left <= 0:
                    break
                share = -(-left // (len(keys) - position))
                rows = _claim_from_pool(key, owner=owner, at_most=share, now=now)
                claimed.extend(rows)
                if len(rows) == share:
                    may_have_more.append(key)
            keys = may_have_more  # each of them took at least one: the passes end
    return claimed, anything_due


def _claim_from_pool(key: str, *, owner: str, at_most: int, now: datetime) -> list[Operation]:
    """Up to `at_most` of the pool's due calls, within its room, started under `owner`'s lease (in the claim's
    transaction, which holds the claims' lock)."""
    assert connection.in_atomic_block, "a pool's part of a claim commits with the claim"
    lease = timedelta(seconds=settings.LONGHAUL_OPERATION_LEASE_SECONDS)
    pool = pools.state(key, now=now)
    busy = _busy_by_tenant(key, now)
    room = min(_room(pool, now, in_flight=sum(busy.values())), at_most)
    if room <= 0:
        return []
    chosen = [c.op_id for c in _choose(key, room, now, tenant_busy=busy)]
    rows = list(Operation.objects.select_for_update(skip_locked=True, of=("self",))
                .filter(_due(now), pk__in=chosen).order_by("id"))
    # The rows are locked: one UPDATE starts them all.
    Operation.objects.filter(pk__in=[op.pk for op in rows]).update(
        status=OperationStatus.STARTED, lease_owner=owner, lease_expires_at=now + lease,
        attempts=F("attempts") + 1, started_at=now)
    for op in rows:
        op.status, op.lease_owner, op.attempts, op.started_at = OperationStatus.STARTED, owner, op.attempts + 1, now
    pools.spend_requests(pool, len(rows))
    return rows


def waiting_on_pool(key: str, *, limit: int) -> list[int]:
    """Tasks with calls waiting for the pool (to tell them it is paused)."""
    return list(Operation.objects.filter(_claimable(), pool=key, status=OperationStatus.PENDING, mode=GATEWAY)
                .order_by().values_list("task_id", flat=True).distinct()[:limit])


def _expired_calls(now: datetime):
    """Calls started by a gateway job whose lease ran out (it died): operation_pool_inflight_idx."""
    return Operation.objects.filter(status=OperationStatus.STARTED, mode=GATEWAY, lease_expires_at__lt=now)


def _lost_calls(now: datetime):
    return _expired_calls(now).filter(has_side_effects=True)


def settle_lost_calls(*, now: datetime, limit: int = 100) -> int:
    """Calls that must never run twice, left started by a gateway job that died: failed, never run
    again (MCP cannot ask a server whether a tools/call began); their task decides what follows."""
    # One read for both kinds (lost, and poison: attempts bounded here as everywhere); run at every claim,
    # which mostly finds neither. A call that is both is settled as lost.
    found = list(_expired_calls(now).filter(Q(has_side_effects=True) | Q(attempts__gte=settings.LONGHAUL_MAX_ATTEMPTS))
                 .order_by().values_list("pk", "has_side_effects", "attempts")[:2 * limit])
    lost = [op_id for op_id, once, _ in found if once][:limit]
    poison = [(op_id, attempts) for op_id, once, attempts in found if not once][:limit]
    settled = 0
    for op_id in lost:
        log.warning("operation %s: its gateway job died during the call; failing it, not running it again", op_id)
        settled += _finish(op_id, guard=Q(status=OperationStatus.STARTED, lease_expires_at__lt=now), fields={
            "status": OperationStatus.FAILED, "result": None, "error_class": StepTimeout.error_class,
            "error_message": LOST, "finished_at": now, "lease_owner": "", "lease_expires_at": None})
    # Attempts are bounded here as everywhere: a call whose gateway jobs keep dying during it (one that
    # kills its process, say) ends failed rather than being claimed forever; its task decides what follows.
    for op_id, attempts in poison:
        log.warning("operation %s: %s gateway jobs died during it; failing it as poison", op_id, attempts)
        settled += _finish(op_id, guard=Q(status=OperationStatus.STARTED, lease_expires_at__lt=now), fields={
            "status": OperationStatus.FAILED, "result": None, "error_class": "poison",
            "error_message": f"gave up after {attempts} attempts whose gateway job never answered",
            "finished_at": now, "lease_owner": "", "lease_expires_at": None})
    return settled


def retries_left(task_ids: Iterable[int]) -> dict[int, int]:
    """The retries each task's budget has left, read once for a claimed batch's calls."""
    return {pk: max(0, Budget.of(budget).max_retries - retries)
            for pk, budget, retries in Task.objects.filter(pk__in=set(task_ids)).values_list("pk", "budget", "retries")}


@dataclass(frozen=True)
class Outcome:
    """What a gateway job saw of one call it ran, to be recorded on its row."""

    op_id: int
    result: Any = None
    error: StepError | None = None
    usage: dict[str, Any] | None = None
    retries_used: int = 0
    version: str = ""
    answered_at: datetime | None = None  # when the job had the answer: its usage says how long it waited for `now`

    def fields(self, now: datetime) -> dict[str, Any]:
        usage = dict(self.usage or {})
        if self.answered_at is not None:
            usage["recorded_after_ms"] = _ms_between(self.answered_at, now)
        return {
            "status": OperationStatus.FAILED if self.error else OperationStatus.SUCCEEDED,
            "result": None if self.error else self.result,
            "error_class": self.error.error_class if self.error else "",
            "error_message": str(self.error)[:2000] if self.error else "",
            "usage": usage, "version": self.version[:200], "finished_at": now, "lease_owner": "",
            "lease_expires_at": None,
        }


def _ms_between(earlier: datetime, later: datetime) -> int:
    return max(0, int((later - earlier).total_seconds() * 1000))


def record(op_id: int, *, owner: str, result: Any = None, error: StepError | None = None,
           usage: dict[str, Any] | None = None, retries_used: int = 0, version: str = "") -> bool:
    """Store an operation's outcome; if it was its step's last, make the task's next step due."""
    [recorded] = record_many([Outcome(op_id, result, error, usage, retries_used, version)], owner=owner)
    if isinstance(recorded, Exception):
        raise recorded
    return recorded


def record_many(outcomes: Sequence[Outcome], *, owner: str) -> list[bool | Exception]:
    """Store the outcomes a gateway job saw arrive together, in one transaction, and make due the next
    step of each task whose last call of a step is among them (kicks.kick_steps). Returns, in order,
    whether each was recorded (False: its lease ran out and another job took it over) or what stopped it.

    If one outcome cannot be recorded, the batch is rolled back and each is recorded alone: the others
    still land."""
    now = clock.now()
    guard = Lease(owner)
    closing = [_Closing(o.op_id, guard, o.fields(now), o.retries_used) for o in outcomes]
    try:
        return list(_finish_many(closing))
    except Exception as exc:
        if len(outcomes) == 1:
            return [exc]
        log.warning("recording %s call outcomes together failed (%s); recording each alone", len(outcomes), exc)
    alone: list[bool | Exception] = []
    for one in closing:
        try:
            alone.extend(_finish_many([one]))
        except Exception as exc:  # this one's own failure, returned to the call it belongs to
            alone.append(exc)
    return alone


@dataclass(frozen=True)
class Lease:
    """A closing's guard: the call is still started under `owner`'s lease (a gateway job recording what it ran)."""

    owner: str

    def q(self) -> Q:
        return Q(status=OperationStatus.STARTED, lease_owner=self.owner)


@dataclass(frozen=True)
class _Closing:
    op_id: int
    guard: Q | Lease  # what must still hold for this job to close it
    fields: dict[str, Any]  # with finished_at
    retries_used: int = 0


def _finish(op_id: int, *, guard: Q, fields: dict[str, Any], retries_used: int = 0) -> bool:
    """Close an operation (if `guard` still holds); if it was the last its task waited for, make the next step due."""
    return _finish_many([_Closing(op_id, guard, fields, retries_used)])[0]


def _finish_many(closing: Sequence[_Closing]) -> list[bool]:
    """Close operations in one transaction (each if its guard still holds), then, task by task, do what
    follows: make the next step due of a task whose step has no call out any more, look again
    at a question a watch call saw, or stop remote work its ended task no longer wants. Returns which closed.

    The tasks are locked in id order, in one statement, before anything is written (one recorder per task
    at a time, and two recorders never wait on each other in a circle). The calls are then locked and
    closed a few statements a batch, not one or more a call: a wave of outcomes is one recorder's work. The
    steps made due are kicked together, as many kicks as there are workers (kicks.kick_steps)."""
    with transaction.atomic():
        op_ids = [c.op_id for c in closing]
        tasks = {t.pk: t for t in _lock_tasks_of(op_ids)}
        held = _held(closing)
        # Not held: gone, or our lease expired and another job took the operation over.
        closed = [c.op_id in held for c in closing]
        retries: Counter[int] = Counter()
        written: list[tuple[Operation, dict[str, Any]]] = []
        for c in closing:
            if c.op_id in held:
                op = held[c.op_id]
                written.append((op, sealed.wrap(Operation, tasks[op.task_id].tenant_id, c.fields)))
                retries[op.task_id] += c.retries_used
        _store(written)
        for task_id, used in retries.items():
            if used:
                Task.objects.filter(pk=task_id).update(retries=F("retries") + used)
        if written:
            now = closing[0].fields["finished_at"]
            out = _steps_with_calls_out({op.task_id for op, _ in written})
            done = {op.task_id: tasks[op.task_id] for op, fields in written
                    if _after_closing(tasks[op.task_id], op, fields["status"], out=out, now=now)}
            due = transitions.operations_done_many(sorted(done.values(), key=lambda task: task.pk), now=now)
            # Not one kick per task: a kick whose task another kick's turn took runs a job that finds nothing.
            kicks.kick_steps(min(len(due), kicks.step_workers()))
    return closed


# The tasks of a recorder's calls, locked in id order: at every batch, so written out (its text does not change
# with the batch); the ORM's model path still makes the rows tasks, and opens their sealed columns.
_TASK_COLUMNS = ", ".join(f'"{field.column}"' for field in Task._meta.concrete_fields)
_TASKS_OF_CALLS = (f'SELECT {_TASK_COLUMNS} FROM "{Task._meta.db_table}" WHERE "id" IN (SELECT "task_id" FROM '
                   f'"{Operation._meta.db_table}" WHERE "id" = ANY(%s)) ORDER BY "id" FOR UPDATE')


def _lock_tasks_of(op_ids: list[int]) -> Iterable[Task]:
    """The tasks of these calls, locked until the commit, in id order (two recorders never wait in a circle)."""
    if connection.vendor == "postgresql":
        return Task.objects.raw(_TASKS_OF_CALLS, [op_ids])
    return Task.objects.select_for_update().filter(
        pk__in=Operation.objects.filter(pk__in=op_ids).values("task_id")).order_by("pk")


# What closing a call reads of it, in the model's order of fields (as Model.from_db takes a row's values).
_HELD_FIELDS = [field for field in Operation._meta.concrete_fields
                if field.attname in {"id", "task_id", "step", "key", "has_side_effects"}]
_HELD_COLUMNS = tuple(field.attname for field in _HELD_FIELDS)
_HELD_SELECT = ", ".join(f'"{field.column}"' for field in _HELD_FIELDS)
# A recorder's calls still under its lease, locked: at every batch, so written out and prepared (tasks/prepared.py).
_HELD_UNDER_LEASE = (f'SELECT {_HELD_SELECT} FROM "{Operation._meta.db_table}" WHERE "id" = ANY(%s) '
                     f"AND \"status\" = '{OperationStatus.STARTED.value}' AND \"lease_owner\" = %s FOR UPDATE")


def _held(closing: Sequence[_Closing]) -> dict[int, Operation]:
    """The calls whose guard still holds (the closing job's lease), locked until the commit, with what closing them
    reads: one statement for a batch, whose calls share their job's guard."""
    by_guard: dict[Q | Lease, list[int]] = {}
    for c in closing:
        by_guard.setdefault(c.guard, []).append(c.op_id)
    held: dict[int, Operation] = {}
    for guard, ids in by_guard.items():
        if isinstance(guard, Lease) and connection.vendor == "postgresql":
            rows = prepared.rows(_HELD_UNDER_LEASE, [ids, guard.owner])
            held.update((row[0], Operation.from_db(connection.alias, _HELD_COLUMNS, row)) for row in rows)
        else:
            q = guard.q() if isinstance(guard, Lease) else guard
            held.update((op.pk, op) for op in Operation.objects.select_for_update(of=("self",))
                        .filter(q, pk__in=ids).only(*_HELD_COLUMNS))
    return held


def _store(rows: list[tuple[Operation, dict[str, Any]]]) -> None:
    """Write each locked call's closing fields (sealed already). On PostgreSQL one UPDATE for the calls
    closed with the same fields (a batch's outcomes), whatever their values."""
    by_fields: dict[tuple[str, ...], list[tuple[int, dict[str, Any]]]] = {}
    for op, fields in rows:
        by_fields.setdefault(tuple(fields), []).append((op.pk, fields))
    for same in by_fields.values():
        if connection.vendor == "postgresql":
            typed_sql.update_each(Operation, same)
        else:
            for pk, fields in same:
                Operation.objects.filter(pk=pk).update(**fields)


# The calls still out of a recorder's tasks: at every batch, so written out and prepared.
_FINISHED_LITERALS = ", ".join(f"'{status}'" for status in FINISHED)
_CALLS_OUT_OF = (f'SELECT "task_id", "step", "key" FROM "{Operation._meta.db_table}" WHERE "task_id" = ANY(%s) '
                 f"AND \"mode\" = '{GATEWAY.value}' AND NOT \"status\" IN ({_FINISHED_LITERALS})")


def _steps_with_calls_out(task_ids: set[int]) -> set[tuple[int, int]]:
    """(task, step) pairs with a call still out that the task waits for (not a watch, not an abandon)."""
    if connection.vendor == "postgresql":
        rows = prepared.rows(_CALLS_OUT_OF, [sorted(task_ids)])
    else:
        rows = (Operation.objects.filter(task_id__in=task_ids, mode=GATEWAY).exclude(status__in=FINISHED)
                .values_list("task_id", "step", "key"))
    return {(task_id, step) for task_id, step, key in rows if _awaited(key)}


def _awaited(key: str) -> bool:
    """task:step:r<n> is a step's call; a<n> belongs to the task's end, w<n> watches while its owner is asked
    (_awaited_of_step says the same in SQL)."""
    return not key.split(":")[2].startswith(("a", WATCH_PREFIX))


def _after_closing(task: Task, op: Operation, status: str, *, out: set[tuple[int, int]], now: datetime) -> bool:
    """Inside the transaction that closed `op`, its task locked: what follows for the task. True when the step
    it waits for has no call out any more: the caller makes the steps of a batch due, and kicks them, together."""
    if task.status in TERMINAL:
        if op.has_side_effects and status == OperationStatus.SUCCEEDED:
            # Work it started (a remote job) outlives a task that ended meanwhile: stop it, once.
            request_abandon(task, now=now)
        return False
    if is_watch(op.key):
        if task.status == TaskStatus.WAITING_INPUT and op.step == task.current_step - 1:
            _after_watch(task, op.pk, now=now)
        return False
    still_waiting = task.status == TaskStatus.WAITING_TOOL or (
        task.status == TaskStatus.RUNNING and task.waiting_reason in ("model", "tool"))
    return still_waiting and op.step >= task.current_step - 1 and (task.pk, op.step) not in out


def _after_watch(task: Task, op_id: int, *, now: datetime) -> None:
    """Inside the recorder's transaction, its task waiting for its owner: watch again later if the
    question still stands, or withdraw it so that the next step reads what the watch saw."""
    if task.cancel_requested_at or task.pause_requested_at:
        return  # the stop acts on the task (tasks/liveness.py makes sure); no more watching
    op = Operation.objects.get(pk=op_id)
    checkpoint = Checkpoint.objects.filter(task_id=task.pk).order_by("-step").first()
    state = checkpoint.state if checkpoint else {}
    if _question_stands(task, op, state):
        again = now + _watch_again_after(task, op, state)
        request(task, token=op.fencing_token, now=now, prefix=WATCH_PREFIX, step=op.step, requests=[
            OpRequest(op.kind, op.name, op.args, not_before=again)])
        kicks.kick("operations", task.pk, at=again)
        return
    transitions.withdraw_question(task, now=now)  # queued: admission gives it a slot and kicks its step


def _question_stands(task: Task, op: Operation, state: dict[str, Any]) -> bool:
    """What the driver makes of a finished watch call. One that did not succeed (the server out of
    reach, a 401, gateway jobs that kept dying) says nothing about the question: it stands."""
    from tasks.drivers import get_driver

    if op.status != OperationStatus.SUCCEEDED:
        return True
    try:
        driver = get_driver(task.kind)
        return bool(driver.question_stands(state, op.result))  # type: ignore[attr-defined]
    except Exception:  # a driver's bug must not keep the task waiting on a question nobody can see through
        log.exception("task %s: could not tell whether its question still stands", task.pk)
        return False


def _watch_again_after(task: Task, op: Operation, state: dict[str, Any]) -> timedelta:
    """How long a standing question waits for its next watch: a minute, or longer if the driver says
    its remote asks to be polled less often."""
    from tasks.drivers import get_driver

    try:
        every = getattr(get_driver(task.kind), "watch_every", None)
        asked = every(state, op.result if op.status == OperationStatus.SUCCEEDED else None) if every else None
    except Exception:  # a driver's bug leaves the default, never the question unwatched
        log.exception("task %s: could not tell when to watch its remote task again", task.pk)
        asked = None
    return max(WATCH_AGAIN_AFTER, asked) if asked is not None else WATCH_AGAIN_AFTER


async def _execute(op: Operation, *, client: Any, budget: Any) -> tuple[Any, dict[str, Any]]:
    if op.kind == "mcp":
        from tasks.mcp import calls

        return await calls.run(op.name, op.args, task_id=op.task_id, budget=budget), {}
    if op.kind == "model":
        from tasks.gateway.providers import ModelCall, get_provider

        answer = await get_provider().run(ModelCall(op.name, op.args), client=client, budget=budget)
        return answer.output, {**answer.usage, "model": answer.model}
    from tasks.gateway.tools import ToolCall, run_tool

    return await run_tool(ToolCall(op.name, op.args), client=client, budget=budget), {}


def version_of(op: Operation, usage: dict[str, Any]) -> str:
    """What ran the call: the model that answered (else the configured one) with the prompts' version,
    or the protocol of the tool or MCP server."""
    if op.kind == "mcp":
        from tasks.mcp.client import TOOL_PROTOCOL as MCP_PROTOCOL

        return MCP_PROTOCOL
    if op.kind == "model":
        from tasks.gateway.providers import PROMPT_VERSION, model_label

        label = model_label()
        answered = usage.get("model")
        if isinstance(answered, str) and answered and not label.endswith(f":{answered}"):
            label = f"{label.split(':', 1)[0]}:{answered}"
        return f"{label} prompts/{PROMPT_VERSION}"
    from tasks.gateway.tools import TOOL_PROTOCOL

    return f"{op.name} {TOOL_PROTOCOL}"


class Recorder:
    """A gateway job's outcomes, recorded in batches: those that arrive while a batch is being written go
    together in the next (record_many), with the tokens their model calls used. A wave of answers then costs
    a few transactions, not one each.

    Up to WRITERS batches are written at once, each on a database thread and connection of its own: while
    one batch waits on the database, the next is written, so a wave's last answers do not queue behind all
    the others' transactions one at a time. Two batches never wait on each other in a circle: each locks
    its tasks in id order, then only its own calls (_finish_many), as two jobs' recorders always have."""

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self._waiting: list[tuple[Outcome, str, int, asyncio.Future[bool]]] = []
        self._writers: list[asyncio.Task[None] | None] = [None] * WRITERS
        self._threads: list[DatabaseThread | None] = [None] * WRITERS
        self._closed = False
        self.batches = 0  # written so far

    async def record(self, outcome: Outcome, *, pool: str, tokens: int = 0) -> bool:
        """Whether it was recorded (False: another job took the call over); raises what stopped it."""
        if self._closed:  # its database threads are given back: nothing would write it
            raise InternalError("the gateway job's recorder was closed before the outcome came")
        answer: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._waiting.append((outcome, pool, tokens, answer))
        # A writer starts on the loop's next turn and takes everything waiting then: the outcomes handed in
        # meanwhile go in its batch, and a second writer finds none and ends.
        for i, writer in enumerate(self._writers):
            if writer is None or writer.done():
                thread = self._threads[i] = self._threads[i] or DatabaseThread(f"gateway-recorder-{i}")
                self._writers[i] = asyncio.create_task(self._write(thread))
                break
        return await answer

    async def closed(self) -> None:
        """Once every outcome handed in is written; it takes no more, and gives back its database threads and
        their connections (again, it does nothing)."""
        self._closed = True
        try:
            await asyncio.gather(*(w for w in self._writers if w is not None), return_exceptions=True)
        finally:
            for i, thread in enumerate(self._threads):
                self._threads[i] = None
                if thread is not None:
                    with contextlib.suppress(Exception):  # the others are given back all the same
                        await thread.close()

    async def _write(self, thread: DatabaseThread) -> None:
        batch: list[tuple[Outcome, str, int, asyncio.Future[bool]]] = []
        try:
            while self._waiting:
                # A cap, so that one batch holds its tasks' locks for a bounded time.
                batch, self._waiting = self._waiting[:BATCH_AT_MOST], self._waiting[BATCH_AT_MOST:]
                self.batches += 1
                try:
                    recorded = await thread.run(self._write_batch, batch)
                except Exception as exc:  # the database is out of reach: every call of the batch hears it
                    recorded = [exc] * len(batch)
                for (_, _, _, answer), done in zip(batch, recorded, strict=True):
                    if answer.done():
                        continue
                    if isinstance(done, Exception):
                        answer.set_exception(done)
                    else:
                        answer.set_result(done)
                batch = []
        finally:
            # Cancelled or worse: no call may wait for ever on an answer that will not come.
            for _, _, _, answer in [*batch, *self._waiting]:
                if not answer.done():
                    answer.set_exception(InternalError("the gateway job stopped before the outcome was recorded"))
            self._waiting = []

    def _write_batch(self, batch: list[tuple[Outcome, str, int, asyncio.Future[bool]]]) -> list[bool | Exception]:
        recorded = record_many([outcome for outcome, _, _, _ in batch], owner=self.owner)
        spent: Counter[str] = Counter()
        for (_, pool, tokens, _), done in zip(batch, recorded, strict=True):
            if tokens and not isinstance(done, Exception):  # spent at the provider, recorded by us or not
                spent[pool] += tokens
        for pool, tokens in spent.items():
            try:
                pools.spend_tokens(pool, tokens, now=clock.now())
            except Exception:  # the outcomes are recorded: a failed count must not make their calls look lost
                log.exception("pool %s: could not count %s tokens", pool, tokens)
        return recorded


async def _run_one(op: Operation, *, owner: str, client: Any, recorder: Recorder | None = None,
                   retries: int | None = None) -> None:
    """Run one claimed call and record its outcome (`retries`: its task's retries left, read with the claim)."""
    if recorder is None:  # a call run on its own: a recorder of its own, its database threads closed after it
        recorder = Recorder(owner)
        try:
            return await _run_one(op, owner=owner, client=client, recorder=recorder, retries=retries)
        finally:
            await recorder.closed()
    from tasks.gateway.retry import RetryBudget

    if retries is None:
        retries = (await sync_to_async(retries_left)([op.task_id])).get(op.task_id, 0)
    budget = RetryBudget(retries)
    # Looked up while the database answers: if recording the call's outcome fails, the database may be
    # what failed, and the remote task it created must still be cancelled.
    cancel_on = await sync_to_async(_compensation_server)(op) if _may_need_compensation(op) else None
    # The call's time in the job beside its remote work, in its usage: from its claim (its row's started_at, the
    # claim transaction's start) to here (the rest of that transaction, then the event loop busy with other calls),
    # and from its answer to its record's start (the recorder busy with other answers: Outcome.fields).
    began = clock.now()
    waited = {"started_after_ms": _ms_between(op.started_at, began)} if op.started_at else {}
    started = time.monotonic()
    result, usage, error = None, None, None
    try:
        result, usage = await asyncio.wait_for(_execute(op, client=client, budget=budget),
                                               timeout=settings.LONGHAUL_OPERATION_LEASE_SECONDS * 0.9)
    except StepError as exc:
        error = exc
    except TimeoutError:
        error = StepTimeout(f"{op.kind} call {op.name} ran out of time")
    except Exception as exc:  # a gateway bug is recorded on the operation, not raised into the loop
        log.exception("operation %s failed", op.key)
        error = InternalError(f"internal error in {op.kind} call {op.name} ({type(exc).__name__})",
                              detail=traceback.format_exc())
    if isinstance(error, RateLimited) and error.retry_after is not None and pools.pauses_on_rate_limit(op.pool):
        # The provider asks every caller to wait: the pool pauses, and this call runs again when it ends,
        # if its task has a retry left and still waits for it.
        now = clock.now()
        until, news = await sync_to_async(pools.pause)(op.pool, seconds=error.retry_after, reason=str(error), now=now)
        handed_back = budget.take() and await sync_to_async(defer)(op, owner=owner, until=until,
                                                                   retries_used=budget.used)
        if news:
            await sync_to_async(pools.tell_waiting)(op.pool, until=until, now=now)
        if handed_back:
            return
    usage = {**(usage or {}), "duration_ms": int((time.monotonic() - started) * 1000), **waited}
    tokens = 0
    if error is None and op.kind == "model":
        tokens = sum(v for k, v in usage.items() if k in ("prompt_tokens", "completion_tokens") and isinstance(v, int))
    outcome = Outcome(op.pk, result, error, usage, budget.used, version_of(op, usage), answered_at=clock.now())
    recording = asyncio.ensure_future(recorder.record(outcome, pool=op.pool, tokens=tokens))
    compensable = error is None and cancel_on is not None
    try:
        await (asyncio.shield(recording) if compensable else recording)
    except BaseException as raised:
        if compensable:
            # The record failed, or the job stops while it is being written (a drain, an error in its loop) and
            # it is written all the same: should it fail, nothing but this would cancel the remote task.
            await asyncio.wait([recording])
            failed = None if recording.cancelled() else recording.exception()
            if failed is not None:
                if failed is not raised:  # the job's stop is raised, not the record's error: said here
                    log.error("operation %s: its outcome could not be recorded", op.key, exc_info=failed)
                await _compensate(op, result, cancel_on)
        raise


def defer(op: Operation, *, owner: str, until: datetime, retries_used: int) -> bool:
    """Hand a call its provider rate-limited back to its pool, due when the pause ends. The retries it drew
    are counted on its task, so 429s are bounded by the task's one retry budget; a clean hand-back is not
    an attempt whose gateway job died, so its attempt is given back."""
    with transaction.atomic():
        task = Task.objects.select_for_update().only("status").get(pk=op.task_id)  # the recorders' lock order
        if task.status in TERMINAL:
            return False  # ended meanwhile: the call is recorded as it ended, and _finish sees to the rest
        handed = Operation.objects.filter(pk=op.pk, status=OperationStatus.STARTED, lease_owner=owner).update(
            status=OperationStatus.PENDING, lease_owner="", lease_expires_at=None, started_at=None, not_before=until,
            attempts=F("attempts") - 1)
        if handed:
            Task.objects.filter(pk=op.task_id).update(retries=F("retries") + retries_used)
            kicks.kick("operations", op.task_id, at=until)
    return bool(handed)


def _may_need_compensation(op: Operation) -> bool:
    from tasks.mcp import calls

    return op.kind == "mcp" and op.name == calls.CALL_TOOL


def _compensation_server(op: Operation) -> ServerConfig | None:
    """For a tools/call: the server its remote task is cancelled on should its outcome not be recorded
    (None for other calls, and for a server this task's workspace may no longer use)."""
    from tasks.mcp import config

    if not _may_need_compensation(op):
        return None
    slug = Task.objects.filter(pk=op.task_id).values_list("tenant__slug", flat=True).first()
    server = config.servers().get(str(op.args.get("server")))
    if server is None or slug is None or not server.allows(slug):
        return None
    return server.config


async def _compensate(op: Operation, result: Any, server: ServerConfig | None) -> None:
    """A remote job was created but its handle could not be recorded: nothing would ever follow or
    stop it, so it is cancelled, once, with no database read (the database may be what failed), and the
    cancel goes through even if the job stops meanwhile. The caller re-raises the recording's error; a failure
    here is only logged."""
    handle = remote_handle_of(result)
    if server is None or handle is None:
        return
    log.error("operation %s: the remote task it created could not be recorded; cancelling it", op.key)
    cancelling = asyncio.ensure_future(_cancel_unrecorded(op, server, handle))
    try:
        await asyncio.shield(cancelling)
    except asyncio.CancelledError:
        # The job stops meanwhile (an error in its own loop, the database's perhaps; a drain): the cancel is all
        # that would ever stop the remote task, so it goes through first, within the server's timeout.
        await asyncio.wait([cancelling])
        raise


async def _cancel_unrecorded(op: Operation, server: ServerConfig, handle: str) -> None:
    try:
        from tasks.mcp import client

        await client.cancel_task_async(server, handle)
    except BaseException:
        log.exception("operation %s: cancelling the unrecorded remote task failed too", op.key)


def remote_handle_of(result: Any) -> str | None:
    """The remote task id a tools/call's stored result carries, if it created one."""
    task = result.get("task") if isinstance(result, dict) else None
    handle = task.get("task_id") if isinstance(task, dict) else None
    return handle if isinstance(handle, str) and handle else None


class Watchdog:
    """A delayed gateway kick for when the leases of the calls a job has claimed run out: if the job dies
    with them, the next job takes them over then, not at the next sweep. A job that ends well withdraws it."""

    def __init__(self) -> None:
        self.kick_id: int | None = None
        self.at: datetime | None = None

    def cover(self, now: datetime) -> None:
        """After a claim at `now`: make sure the kick comes after these calls' leases run out."""
        needed = now + timedelta(seconds=settings.LONGHAUL_OPERATION_LEASE_SECONDS) + WATCHDOG_MARGIN
        if self.at is not None and self.at >= needed:
            return
        # One kick per job, moved later in steps as it claims more (not one broker row per claim).
        self.withdraw()
        self.at = needed + WATCHDOG_STEP
        self.kick_id = kicks.kick("operations", 0, at=self.at)

    def withdraw(self) -> None:
        if self.kick_id is not None:
            kicks.withdraw(self.kick_id)
            self.kick_id, self.at = None, None


async def _hand_back(in_flight: dict[asyncio.Task[None], int], *, owner: str, recorder: Recorder) -> None:
    """Stop waiting for calls in flight and release them, so another gateway job runs them again under
    the same key; a call that must never run twice is left to its lease (settle_lost_calls fails it).
    Outcomes already handed to the recorder are written first."""
    await _stop(in_flight)
    await recorder.closed()
    released = await sync_to_async(release)(owner=owner, ids=in_flight.values())
    log.warning("gateway job draining: %s calls in flight handed back", released)


async def _stop(calls: Iterable[asyncio.Task[None]]) -> None:
    """Cancel the calls and wait until each has stopped."""
    running = list(calls)
    for call in running:
        call.cancel()
    await asyncio.gather(*running, return_exceptions=True)


def release(*, owner: str, ids: Iterable[int]) -> int:
    """A draining job's started calls (`ids`) back to pending, for another job; not those that must not run twice.
    Their attempts stay counted, so a call that keeps hanging through drains is still bounded. By id as well as
    owner: the process's other gateway job (tasks/gateway_thread.py) claims under the same owner, and its calls
    are its own to hand back or record."""
    return Operation.objects.filter(pk__in=list(ids), status=OperationStatus.STARTED, mode=GATEWAY,
                                    lease_owner=owner, has_side_effects=False).update(
        status=OperationStatus.PENDING, lease_owner="", lease_expires_at=None, started_at=None)


async def pump(*, owner: str, run_for: float, took_turn: Callable[[], None] = lambda: None,
               stopped_claiming: Callable[[], None] = lambda: None) -> int | None:
    """Claim and run operations until none are due (with more than one turn: until its slice ends) or
    `run_for` seconds have passed, and its calls out have answered; returns how
    many ran, or None when other jobs hold every gateway turn. `took_turn` is called once the job
    holds a turn, `stopped_claiming` once it claims no more (it may still wait for its calls out).

    The turn is held on the claims' own connection: in a process whose next job starts while this one
    waits for its last calls (tasks/gateway_thread.py), each job's turn is a session of its own, so the
    next cannot take the same turn while this one holds it, and closing one job's connections drops no
    other's turn."""
    from tasks.gateway.transport import gateway_client

    claims = DatabaseThread("gateway-claims")
    turn = None
    try:
        turn = await claims.run(take_gateway_turn)
    finally:
        if turn is None:
            await claims.close()
    if turn is None:
        return None
    holding = True
    in_flight: dict[asyncio.Task[None], int] = {}  # each call out, and its operation's id
    watchdog = Watchdog()
    recorder = Recorder(owner)
    listener = requested.Listener()
    ran = 0
    cap = calls_at_most(settings.LONGHAUL_GATEWAY_INFLIGHT)
    # With one turn, a job with nothing out and nothing to claim ends: the next step asking for calls kicks one. With
    # more, it keeps its turn and listens until its slice ends (given back, the turn would be free, and every step
    # asking for calls would kick a job to take it, one job per step, each finding its calls already claimed by a
    # job that heard them), and claims in shares. SQLite has no turns (every job "takes" one, and no job listens):
    # a job there ends when it has nothing to do.
    several_turns = settings.LONGHAUL_GATEWAY_TURNS > 1 and connection.vendor == "postgresql"
    try:
        took_turn()
        CALLS_OUT[id(in_flight)] = in_flight
        await listener.start(await sync_to_async(requested.conninfo)())
        async with gateway_client(cap) as client:
            stop_claiming = time.monotonic() + run_for  # the slice starts once the job can claim
            while True:
                claiming = time.monotonic() < stop_claiming and not draining.is_set() and not drain.ending.is_set()
                if draining.is_set() and in_flight and drain.grace_over():
                    # The worker is stopping: calls still out are handed to another worker, not waited for.
                    await _hand_back(in_flight, owner=owner, recorder=recorder)
                    in_flight.clear()
                    break
                if holding and not claiming and in_flight:
                    # The slice is over: let the next job claim while this one waits for its last calls.
                    await claims.run(end_gateway_turn, turn)
                    holding = False
                    stopped_claiming()
                    await listener.stop()
                    await _on_claims_thread(claims, kick_if_claimable)
                    await claims.close()
                room = cap - calls_out()
                batch, anything_due = [], True
                if room > 0 and claiming:
                    listener.heard.clear()  # before the claim: a commit heard during it calls for another
                    share = min(room, SHARE_AT_MOST) if several_turns else room
                    batch, retries, anything_due = await claims.run(_claim_for, owner, share, watchdog)
                    for op in batch:
                        in_flight[asyncio.create_task(_run_one(
                            op, owner=owner, client=client, recorder=recorder,
                            retries=retries.get(op.task_id, 0)))] = op.pk
                    ran += len(batch)
                    if several_turns and len(batch) == share and share < room:
                        continue  # more may be due: claim again, after the other jobs waiting at the claims' lock
                if not in_flight:
                    if claiming and room <= 0:
                        # The process's other job, waiting for its last calls, fills the cap: look again once some
                        # end.
                        await asyncio.sleep(requested.LOOK_EVERY)
                        continue
                    if not (claiming and several_turns):
                        break
                # Until a call ends, calls are requested (while there is room to claim them), or it is time to look.
                # After a claim that found calls due but took none (their pools full or held back), what is heard
                # waits for a call to end or that look: it could only be held back too. After one that found
                # nothing due, what is heard is the only thing to claim.
                listen = (claiming and (bool(batch) or not anything_due)
                          and calls_out() < cap)
                heard = asyncio.create_task(listener.heard.wait()) if listen else None
                if not in_flight and heard is None:  # its calls due are held back: look again
                    await asyncio.sleep(requested.LOOK_EVERY)
                    continue
                done, _ = await asyncio.wait({*in_flight, *([heard] if heard else [])}, timeout=requested.LOOK_EVERY,
                                             return_when=asyncio.FIRST_COMPLETED)
                if heard is not None:
                    heard.cancel()
                    done.discard(heard)
                for finished in done:
                    del in_flight[finished]
                    if not finished.cancelled() and finished.exception() is not None:
                        # Its outcome could not be recorded (the database refused it); its lease runs out.
                        log.error("a call's outcome could not be recorded", exc_info=finished.exception())
    finally:
        try:
            # Left by an error: the calls still out stop here, unrecorded (their leases run out, as when a job
            # dies), so that no outcome comes to the recorder once it is closed.
            await _stop(in_flight)
            await listener.stop()
            await recorder.closed()
            if not in_flight:
                await _on_claims_thread(claims, watchdog.withdraw)  # every call it claimed is recorded
        finally:
            try:
                if holding:
                    await claims.run(end_gateway_turn, turn)
                    holding = False
                stopped_claiming()
                # Also after a late drain: calls due when the pool was full (of this job's calls) wait for a kick.
                await _on_claims_thread(claims, kick_if_claimable)
            finally:
                CALLS_OUT.pop(id(in_flight), None)
                # This loop's database connections live in the claims' thread, the recorder's (closed with it) and
                # asgiref's, which the process's gateway jobs share (another one's next use there reconnects): give
                # them back.
                await claims.close()
                await sync_to_async(connections.close_all)()
    return ran


async def _on_claims_thread(claims: DatabaseThread, fn: Callable[[], T]) -> T:
    """A job's database work after its claims, on the claims' connection while it is open: on asgiref's thread,
    whose connection each job closes as it ends, it paid for a new session and its cold caches (an empty job's
    last look took 18 ms there, 4 on the claims' connection, of the job's 59)."""
    if claims.closed:
        return await sync_to_async(fn)()
    return await claims.run(_usable_then, fn)


def _usable_then(fn: Callable[[], T]) -> T:
    """Run `fn` on the claims' connection, or on a new one if a failed claim left it broken. Never replaced for its age
    alone (close_old_connections would, past CONN_MAX_AGE): it holds the turn, which lasts until the job gives it back."""
    if connection.connection is not None and connection.errors_occurred and not connection.is_usable():
        connection.close()
    return fn()


# The calls out with each gateway job of this process. The cap (LONGHAUL_GATEWAY_INFLIGHT) and the open files it
# asks for (tasks/descriptors.py) are the process's, and a job waiting for its last calls may run beside the next
# (tasks/gateway_thread.py), on another thread: each reads the others' (by id), whose len() is atomic.
CALLS_OUT: dict[int, Sized] = {}


def calls_out() -> int:
    """The calls out with this process's gateway jobs."""
    return sum(map(len, list(CALLS_OUT.values())))


class DatabaseThread:
    """A thread with a database connection of its own, for one kind of a gateway job's database work (its
    claims; each of its recorder's writers): its claims do not wait behind batches of outcomes, nor a batch
    behind the claims or another batch."""

    def __init__(self, name: str) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, functools.partial(fn, *args))

    async def close(self) -> None:
        """Close its connections and end the thread; again, it does nothing."""
        if self._closed:
            return
        self._closed = True
        try:
            await asyncio.get_running_loop().run_in_executor(self._executor, connections.close_all)
        finally:
            self._executor.shutdown(wait=False)


def _claim_for(owner: str, limit: int, watchdog: Watchdog) -> tuple[list[Operation], dict[int, int], bool]:
    """One trip to the database thread: a batch claimed, its watchdog moved, its tasks' retries read, and
    whether any call was due before it claimed."""
    now = clock.now()
    batch, anything_due = _claim(owner=owner, limit=limit, now=now)
    if not batch:
        return [], {}, anything_due
    watchdog.cover(now)
    return batch, retries_left(op.task_id for op in batch), anything_due


def run_due(*, run_for: float | None = None, took_turn: Callable[[], None] = lambda: None,
            stopped_claiming: Callable[[], None] = lambda: None) -> int | None:
    """The gateway job's body: one event loop running many calls at once (None: other jobs had every turn)."""
    owner = leases.worker_identity()
    return asyncio.run(pump(owner=owner, run_for=settings.LONGHAUL_GATEWAY_SLICE_SECONDS if run_for is None
                            else run_for, took_turn=took_turn, stopped_claiming=stopped_claiming))


def due_exists(now: datetime) -> bool:
    """For the sweeper: due operations nobody is running (pending, or their job died) that a gateway job
    could start now. Those held back by their pool's rate or pause, or by their task's cap, are not: a
    kick waits for the first two (kick_if_claimable), and the calls of the task out now end the third.
    Calls that must not run twice, left started by a job that died, are due too: a job settles them."""
    return _lost_calls(now).exists() or claimable_exists(now)
