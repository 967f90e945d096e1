"""Model and tool calls that steps request, executed by gateway jobs.

A step never waits on the network: it asks for Operations and the task waits
(waiting_tool, or running with waiting_reason "model") holding no worker. A gateway
job claims pending operations in batches, under each pool's concurrency cap shared
by every process, runs them concurrently on one event loop, records each result on
its row, and when a task's last operation of a step is done, makes the next step due
and kicks it. A finished operation is never executed again; one whose gateway job
died is claimed again when its lease expires.
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
from django.db import connection, connections, transaction
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
            in_flight = Operation.objects.filter(kind=kind, status=OperationStatus.STARTED, args__isnull=False,
                                                 lease_expires_at__gte=now).count()
            free = min(pool_size(kind) - in_flight, limit - len(claimed))
            if free <= 0:
                continue
            waiting = Q(task__status=TaskStatus.WAITING_TOOL) | Q(task__status=TaskStatus.RUNNING,
                                                                   task__waiting_reason__in=("model", "tool"))
            due = Q(status=OperationStatus.PENDING) | Q(status=OperationStatus.STARTED, lease_expires_at__lt=now)
            rows = list(
                Operation.objects.select_for_update(skip_locked=True, of=("self",))
                .filter(due, waiting, kind=kind, args__isnull=False)
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
        from tasks.gateway.models import ModelCall, get_provider

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


async def pump(*, owner: str, run_for: float) -> int:
    """Claim and run operations until none are due or `run_for` seconds have passed; returns how many ran."""
    import httpx

    stop_claiming = time.monotonic() + run_for
    in_flight: set[asyncio.Task[None]] = set()
    ran = 0
    # httpx's default pool holds 100 connections whatever LONGHAUL_GATEWAY_INFLIGHT says.
    pool = httpx.Limits(max_connections=settings.LONGHAUL_GATEWAY_INFLIGHT,
                        max_keepalive_connections=settings.LONGHAUL_GATEWAY_INFLIGHT)
    async with httpx.AsyncClient(follow_redirects=False, limits=pool) as client:
        while True:
            room = settings.LONGHAUL_GATEWAY_INFLIGHT - len(in_flight)
            if room > 0 and time.monotonic() < stop_claiming:
                batch = await sync_to_async(claim_batch)(owner=owner, limit=room, now=clock.now())
                for op in batch:
                    in_flight.add(asyncio.create_task(_run_one(op, owner=owner, client=client)))
                ran += len(batch)
            if not in_flight:
                break
            done, _ = await asyncio.wait(in_flight, timeout=0.25, return_when=asyncio.FIRST_COMPLETED)
            in_flight -= done
    # This loop's database connections live in asgiref's executor thread: give them back.
    await sync_to_async(connections.close_all)()
    return ran


def run_due(*, run_for: float | None = None) -> int:
    """The gateway job's body: one event loop running many calls at once."""
    owner = leases.worker_identity()
    return asyncio.run(pump(owner=owner, run_for=settings.LONGHAUL_GATEWAY_SLICE_SECONDS if run_for is None
                            else run_for))


def due_exists(now: datetime) -> bool:
    """For the sweeper: operations nobody is running (pending, or their job died)."""
    return Operation.objects.filter(args__isnull=False).filter(
        Q(status=OperationStatus.PENDING) | Q(status=OperationStatus.STARTED, lease_expires_at__lt=now)
    ).filter(Q(task__status=TaskStatus.WAITING_TOOL) | Q(task__status=TaskStatus.RUNNING,
                                                          task__waiting_reason__in=("model", "tool"))).exists()
