"""Model and tool calls that steps request, executed by gateway jobs.

A step never waits on the network: it asks for Operations and the task waits
(waiting_tool, or running with waiting_reason "model") holding no worker. A gateway
job claims pending operations in batches, under each pool's concurrency cap shared
by every process, runs them concurrently on one event loop, records each result on
its row, and when a task's last operation of a step is done, makes the next step due
and kicks it. A finished operation is never executed again; one whose gateway job
died is claimed again when its lease expires.

On PostgreSQL one gateway job claims at a time per database (a session advisory lock):
one event loop keeps hundreds of calls in flight, so a second job would only hold a
second worker process for its whole slice while step kicks queue behind both. A job
that finds the lock taken returns at once; the holder kicks again on its way out if
work is left, so nothing waits for the sweeper while a holder lives.
"""

from __future__ import annotations

import asyncio
import logging
import time
import traceback
import zlib
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import close_old_connections, connection, connections, transaction
from django.db.models import F, Q

from tasks import clock, kicks, leases, transitions
from tasks.budgets import Budget
from tasks.context import digest
from tasks.drivers import OpRequest
from tasks.errors import InternalError, StepError, StepTimeout
from tasks.models import Operation, Task
from tasks.statuses import OperationStatus, TaskStatus

log = logging.getLogger(__name__)
KINDS = ("model", "tool")
FINISHED = (OperationStatus.SUCCEEDED, OperationStatus.FAILED)


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


def pool_size(kind: str) -> int:
    return int(settings.LONGHAUL_MODEL_CONCURRENCY if kind == "model" else settings.LONGHAUL_TOOL_CONCURRENCY)


# --- the step side -------------------------------------------------------------


def request(task: Task, *, token: int, requests: list[OpRequest], now: datetime) -> None:
    """Inside the step's commit: store the requested operations as pending rows."""
    step = task.current_step
    Operation.objects.bulk_create(
        Operation(task_id=task.pk, key=f"{task.pk}:{step}:r{n}", step=step, n=n, kind=r.kind, name=r.name,
                  args=r.args, args_digest=digest(r.args), status=OperationStatus.PENDING, fencing_token=token,
                  attempts=0, created_at=now)
        for n, r in enumerate(requests)
    )


def outcomes(task_id: int, step: int) -> list[OpOutcome]:
    """The operations requested by `step`, in request order."""
    rows = Operation.objects.filter(task_id=task_id, step=step, args__isnull=False).order_by("n")
    return [
        OpOutcome(name=op.name, args=op.args, ok=op.status == OperationStatus.SUCCEEDED, result=op.result,
                  error_class=op.error_class, error_message=op.error_message, usage=op.usage)
        for op in rows
    ]


def unfinished(task_id: int, step: int) -> bool:
    return (
        Operation.objects.filter(task_id=task_id, step=step, args__isnull=False)
        .exclude(status__in=FINISHED)
        .exists()
    )


def waits_on_tool(task_id: int, step: int) -> bool:
    return (
        Operation.objects.filter(task_id=task_id, step=step, kind="tool", args__isnull=False)
        .exclude(status__in=FINISHED)
        .exists()
    )


# --- the gateway side ----------------------------------------------------------


# One gateway job claims at a time, per database: the key of its session advisory lock.
GATEWAY_TURN_KEY = zlib.crc32(b"longhaul-gateway-turn")


def take_gateway_turn() -> bool:
    """Try to become the job that claims operations; False when another job is claiming.

    A session lock, not a transaction's: it is held across the many short claim
    transactions of one job, and PostgreSQL drops it if the job's process dies.
    SQLite (the embedded mode) has no advisory locks; its gateway jobs share the work.
    """
    # A refused job keeps its connection for the next one; drop it if it has gone bad meanwhile.
    close_old_connections()
    if connection.vendor != "postgresql":
        return True
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_try_advisory_lock(%s)", [GATEWAY_TURN_KEY])
        return bool(cursor.fetchone()[0])


def end_gateway_turn() -> None:
    if connection.vendor != "postgresql":
        return
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_advisory_unlock(%s)", [GATEWAY_TURN_KEY])


def waiting_task() -> Q:
    """Operations whose task still waits for them (a cancelled or paused task's calls are not run)."""
    return Q(task__status=TaskStatus.WAITING_TOOL) | Q(task__status=TaskStatus.RUNNING,
                                                        task__waiting_reason__in=("model", "tool"))


def _due(now: datetime) -> Q:
    """Pending, or started by a job whose lease ran out (it died)."""
    return Q(status=OperationStatus.PENDING) | Q(status=OperationStatus.STARTED, lease_expires_at__lt=now)


def _in_flight(kind: str, now: datetime) -> int:
    return Operation.objects.filter(kind=kind, status=OperationStatus.STARTED, args__isnull=False,
                                    lease_expires_at__gte=now).count()


def claimable_exists(now: datetime) -> bool:
    """Due operations that a gateway job could claim now: its pool has a free slot."""
    for kind in KINDS:
        due = Operation.objects.filter(_due(now), waiting_task(), kind=kind, args__isnull=False)
        if due.exists() and _in_flight(kind, now) < pool_size(kind):
            return True
    return False


def kick_if_claimable() -> bool:
    """On a gateway job's way out: hand the work left over to the next job.

    Jobs refused the turn while this one held it returned without claiming; their
    operations were committed before they were refused, so this check sees them.
    A pool that is full waits for the jobs running its calls, which look again when
    they end, so this never kicks in a loop.
    """
    if not claimable_exists(clock.now()):
        return False
    kicks.kick("operations", 0)
    return True


def _lock_pool(kind: str) -> None:
    """Serialize claims of one pool across processes, so its cap holds everywhere."""
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_xact_lock(%s)", [zlib.crc32(f"longhaul-pool-{kind}".encode())])
    # SQLite: the IMMEDIATE transaction already holds the database's write lock.


def claim_batch(*, owner: str, limit: int, now: datetime) -> list[Operation]:
    """Claim due operations of both pools, each within its free slots."""
    lease = timedelta(seconds=settings.LONGHAUL_OPERATION_LEASE_SECONDS)
    claimed: list[Operation] = []
    for kind in KINDS:
        if len(claimed) >= limit:
            break
        with transaction.atomic():
            _lock_pool(kind)
            free = min(pool_size(kind) - _in_flight(kind, now), limit - len(claimed))
            if free <= 0:
                continue
            rows = list(
                Operation.objects.select_for_update(skip_locked=True, of=("self",))
                .filter(_due(now), waiting_task(), kind=kind, args__isnull=False)
                .order_by("id")[:free]
            )
            for op in rows:
                Operation.objects.filter(pk=op.pk).update(
                    status=OperationStatus.STARTED, lease_owner=owner, lease_expires_at=now + lease,
                    attempts=op.attempts + 1, started_at=now)
                op.status, op.lease_owner, op.attempts = OperationStatus.STARTED, owner, op.attempts + 1
            claimed.extend(rows)
    return claimed


def retries_left(task_id: int) -> int:
    task = Task.objects.only("budget", "retries").get(pk=task_id)
    return max(0, Budget.of(task.budget).max_retries - task.retries)


def record(op_id: int, *, owner: str, result: Any = None, error: StepError | None = None,
           usage: dict[str, Any] | None = None, retries_used: int = 0) -> bool:
    """Store an operation's outcome; if it was its step's last, make the task's next step due."""
    now = clock.now()
    with transaction.atomic():
        op = Operation.objects.filter(pk=op_id).only("task_id", "step").first()
        if op is None:
            return False
        task = Task.objects.select_for_update().get(pk=op.task_id)  # one recorder per task at a time
        done = Operation.objects.filter(pk=op_id, status=OperationStatus.STARTED, lease_owner=owner).update(
            status=OperationStatus.FAILED if error else OperationStatus.SUCCEEDED,
            result=None if error else result,
            error_class=error.error_class if error else "",
            error_message=str(error)[:2000] if error else "",
            usage=usage or {}, finished_at=now, lease_owner="", lease_expires_at=None,
        )
        if not done:
            return False  # our lease expired and another job took the operation over
        if retries_used:
            Task.objects.filter(pk=task.pk).update(retries=F("retries") + retries_used)
        still_waiting = task.status == TaskStatus.WAITING_TOOL or (
            task.status == TaskStatus.RUNNING and task.waiting_reason in ("model", "tool"))
        if still_waiting and not unfinished(task.pk, op.step):
            if transitions.operations_done(task, now=now):
                kicks.kick("advance", task.pk)
    return True


async def _execute(op: Operation, *, client: Any, budget: Any) -> tuple[Any, dict[str, Any]]:
    if op.kind == "model":
        from tasks.gateway.providers import ModelCall, get_provider

        answer = await get_provider().run(ModelCall(op.name, op.args), client=client, budget=budget)
        return answer.output, {**answer.usage, "model": answer.model}
    from tasks.gateway.tools import ToolCall, run_tool

    return await run_tool(ToolCall(op.name, op.args), client=client, budget=budget), {}


async def _run_one(op: Operation, *, owner: str, client: Any) -> None:
    from tasks.gateway.retry import RetryBudget

    budget = RetryBudget(await sync_to_async(retries_left)(op.task_id))
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
    usage = {**(usage or {}), "duration_ms": int((time.monotonic() - started) * 1000)}
    await sync_to_async(record)(op.pk, owner=owner, result=result, error=error, usage=usage,
                                retries_used=budget.used)


async def pump(*, owner: str, run_for: float) -> int | None:
    """Claim and run operations until none are due or `run_for` seconds have passed; returns how
    many ran, or None when another job holds the gateway turn."""
    import httpx

    if not await sync_to_async(take_gateway_turn)():
        return None
    holding = True
    stop_claiming = time.monotonic() + run_for
    in_flight: set[asyncio.Task[None]] = set()
    ran = 0
    # httpx's default pool holds 100 connections whatever LONGHAUL_GATEWAY_INFLIGHT says.
    pool = httpx.Limits(max_connections=settings.LONGHAUL_GATEWAY_INFLIGHT,
                        max_keepalive_connections=settings.LONGHAUL_GATEWAY_INFLIGHT)
    try:
        async with httpx.AsyncClient(follow_redirects=False, limits=pool) as client:
            while True:
                claiming = time.monotonic() < stop_claiming
                if holding and not claiming and in_flight:
                    # The slice is over: let the next job claim while this one waits for its last calls.
                    await sync_to_async(end_gateway_turn)()
                    holding = False
                    await sync_to_async(kick_if_claimable)()
                room = settings.LONGHAUL_GATEWAY_INFLIGHT - len(in_flight)
                if room > 0 and claiming:
                    batch = await sync_to_async(claim_batch)(owner=owner, limit=room, now=clock.now())
                    for op in batch:
                        in_flight.add(asyncio.create_task(_run_one(op, owner=owner, client=client)))
                    ran += len(batch)
                if not in_flight:
                    break
                done, _ = await asyncio.wait(in_flight, timeout=0.25, return_when=asyncio.FIRST_COMPLETED)
                in_flight -= done
    finally:
        if holding:
            await sync_to_async(end_gateway_turn)()
        # Also after a late drain: calls due when the pool was full (of this job's calls) wait for a kick.
        await sync_to_async(kick_if_claimable)()
        # This loop's database connections live in asgiref's executor thread: give them back.
        await sync_to_async(connections.close_all)()
    return ran


def run_due(*, run_for: float | None = None) -> int | None:
    """The gateway job's body: one event loop running many calls at once (None: another job had the turn)."""
    owner = leases.worker_identity()
    return asyncio.run(pump(owner=owner, run_for=settings.LONGHAUL_GATEWAY_SLICE_SECONDS if run_for is None
                            else run_for))


def due_exists(now: datetime) -> bool:
    """For the sweeper: operations nobody is running (pending, or their job died)."""
    return Operation.objects.filter(_due(now), waiting_task(), args__isnull=False).exists()
