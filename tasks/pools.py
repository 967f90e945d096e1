"""Pools: the slots and the rate each gateway call takes, per model, per tool and per MCP server.

A call's pool is named when its step requests it (Operation.pool): "model:<provider>:<model>",
"tool:<tool>" or "mcp:<server>", so one slow search backend or one rate-limited model stalls its
own calls only. Each pool has a concurrency limit and an optional rate limit (requests per minute;
a model pool tokens per minute too), from the settings (project/pools.py). The limits hold across
every process, the database being the coordinator: claims of one pool are serialized by an
advisory lock (tasks/operations.py), calls in flight are counted from their rows, and what must
persist between claims lives on the pool's row (Pool): the rate allowances, refilled continuously
up to a minute's worth, and a pause.

A provider's 429 with Retry-After pauses the pool until then (not the whole gateway): nothing of
it starts meanwhile, the call is handed back to run when the pause ends, and every task waiting on
the pool is told so in its events ("pool_paused").

Within a busy pool the free slots go to tenants by weight, as running slots do (tasks/scheduling.py):
the tenant with the fewest calls out in the pool per unit of weight first (weight 0: leftovers
only), then the oldest call. A task has at most LONGHAUL_TASK_CALLS_IN_FLIGHT calls out at once,
so a step that fans out 30 reads does not take a whole pool from the others.
"""

from __future__ import annotations

import logging
import math
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from fractions import Fraction
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import QuerySet

from tasks import events
from tasks.events import NewEvent
from tasks.models import Pool, Task

log = logging.getLogger(__name__)
PAUSED = "pool_paused"  # the event a task waiting on a paused pool is told
MAX_PAUSE = timedelta(hours=1)  # a Retry-After beyond this is taken as an hour: a typo must not stall a pool for days
TELL_AT_MOST = 500  # tasks told of one pause (the rest see it in /metrics and the admin)
TOOLS = ("search", "visit")  # the gateway's tools (tasks/gateway/tools.py), each a pool


@dataclass(frozen=True)
class Limits:
    concurrency: int
    requests_per_minute: int  # 0: no limit
    tokens_per_minute: int  # 0: no limit; model pools only


@dataclass(frozen=True)
class Candidate:
    """A due call of the pool, as the claim sees it."""

    op_id: int
    task_id: int
    tenant_id: int
    weight: int = 1  # its tenant's, read with it


def key_of(kind: str, name: str, args: Any) -> str:
    """The pool a call takes its slot in."""
    if kind == "model":
        from tasks.gateway.providers import model_label

        return f"model:{model_label()}"
    if kind == "mcp":
        server = args.get("server") if isinstance(args, dict) else None
        return f"mcp:{server or ''}"
    return f"{kind}:{name}"


def pauses_on_rate_limit(key: str) -> bool:
    """Whether a 429 pauses the pool: a provider's does (the model server, the search API). A page's does
    not: visit's pool serves every site, and one site's 429 must not hold up reads of the others."""
    return key != "tool:visit"


def kind_of(key: str) -> str:
    return key.partition(":")[0]


def label(key: str) -> str:
    """What a person calls the pool: "search", "openai:gpt-4o", an MCP server's name."""
    return key.partition(":")[2]


def limits(key: str) -> Limits:
    """The pool's limits: its own from LONGHAUL_POOLS, else its kind's defaults."""
    kind = kind_of(key)
    own = settings.LONGHAUL_POOLS.get(key, {})
    default_concurrency = {"model": settings.LONGHAUL_MODEL_CONCURRENCY, "mcp": settings.LONGHAUL_MCP_CONCURRENCY}
    default_rate = {"model": settings.LONGHAUL_MODEL_REQUESTS_PER_MINUTE, "mcp": settings.LONGHAUL_MCP_REQUESTS_PER_MINUTE}
    return Limits(
        concurrency=int(own.get("concurrency", default_concurrency.get(kind, settings.LONGHAUL_TOOL_CONCURRENCY))),
        requests_per_minute=int(own.get("requests_per_minute",
                                        default_rate.get(kind, settings.LONGHAUL_TOOL_REQUESTS_PER_MINUTE))),
        tokens_per_minute=int(own.get("tokens_per_minute",
                                      settings.LONGHAUL_MODEL_TOKENS_PER_MINUTE if kind == "model" else 0)),
    )


def known() -> list[str]:
    """Pools worth showing before any call used them: those configured, the model's, the tools', the servers'."""
    from tasks.mcp import config

    keys = {key_of("model", "", None), *(f"tool:{name}" for name in TOOLS), *settings.LONGHAUL_POOLS}
    keys.update(f"mcp:{name}" for name in config.servers())
    return sorted(keys)


# --- the claim side: called by tasks/operations.py under the claims' lock --------------


def state(key: str, *, now: datetime) -> Pool:
    """The pool's row, locked, with its allowances refilled to `now`. A pool never used (no row, or one the
    admin listed) starts with a full minute."""
    pool_limits = limits(key)
    pool, _ = Pool.objects.select_for_update().get_or_create(key=key)
    # Never refilled: a full minute's worth, whatever the row says.
    elapsed = 60.0 if pool.refilled_at is None else max(0.0, (now - pool.refilled_at).total_seconds())
    for field, per_minute in (("requests_allowance", pool_limits.requests_per_minute),
                              ("tokens_allowance", pool_limits.tokens_per_minute)):
        if per_minute:
            setattr(pool, field, min(float(per_minute), getattr(pool, field) + elapsed * per_minute / 60))
    pool.refilled_at = now
    return pool


def paused(pool: Pool, *, now: datetime) -> bool:
    return pool.paused_until is not None and pool.paused_until > now


def room(pool: Pool, *, in_flight: int, now: datetime) -> int:
    """Calls the pool may start now: its free slots, within its rate allowances and any pause."""
    pool_limits = limits(pool.key)
    if paused(pool, now=now):
        return 0
    free = pool_limits.concurrency - in_flight
    if pool_limits.requests_per_minute:
        free = min(free, math.floor(pool.requests_allowance))
    if pool_limits.tokens_per_minute and pool.tokens_allowance <= 0:
        return 0  # tokens are known once a call answers: the allowance may run below zero, and is waited out
    return max(0, free)


def next_allowance_at(pool: Pool, *, now: datetime) -> datetime | None:
    """When a pool held back by its rate (not its slots) may start a call again; None if nothing rate-limits it."""
    pool_limits = limits(pool.key)
    waits = []
    if paused(pool, now=now):
        waits.append((pool.paused_until - now).total_seconds())  # type: ignore[operator]
    if pool_limits.requests_per_minute and pool.requests_allowance < 1:
        waits.append((1 - pool.requests_allowance) * 60 / pool_limits.requests_per_minute)
    if pool_limits.tokens_per_minute and pool.tokens_allowance <= 0:
        waits.append((1 - pool.tokens_allowance) * 60 / pool_limits.tokens_per_minute)
    return now + timedelta(seconds=max(waits)) if waits else None


def spend_requests(pool: Pool, started: int) -> None:
    """After claiming `started` calls: take them from the allowance and save the row. A pool with no rate
    limit has no allowance to keep (state() refilled nothing): its row is not written at every claim."""
    pool_limits = limits(pool.key)
    if not (pool_limits.requests_per_minute or pool_limits.tokens_per_minute):
        return
    if pool_limits.requests_per_minute:
        pool.requests_allowance -= started
    pool.save(update_fields=["requests_allowance", "tokens_allowance", "refilled_at"])


def choose(candidates: Iterable[Candidate], *, room: int, tenant_busy: Counter[int], task_room: dict[int, int],
           weights: dict[int, int]) -> list[Candidate]:
    """Which due calls start: free slots go to the tenant with the fewest calls out in the pool per unit of
    weight (weight 0 after every weighted tenant), its oldest call first, skipping tasks at their cap.

    `candidates` come oldest first; `tenant_busy` (calls out in this pool, per tenant) and `task_room`
    (calls a task may still start) are consumed as calls are picked."""
    by_tenant: dict[int, deque[Candidate]] = {}
    for candidate in candidates:
        by_tenant.setdefault(candidate.tenant_id, deque()).append(candidate)
    picked: list[Candidate] = []
    while room > 0 and by_tenant:
        tenant = min(by_tenant, key=lambda t: (weights.get(t, 1) == 0,
                                               Fraction(tenant_busy[t], weights.get(t, 1) or 1),
                                               by_tenant[t][0].op_id))
        queue = by_tenant[tenant]
        candidate = queue.popleft()
        if not queue:
            del by_tenant[tenant]
        if task_room.get(candidate.task_id, 0) <= 0:
            continue
        picked.append(candidate)
        task_room[candidate.task_id] -= 1
        tenant_busy[tenant] += 1
        room -= 1
    return picked


# --- what calls tell the pool ------------------------------------------------------------


def spend_tokens(key: str, tokens: int, *, now: datetime) -> None:
    """A model call answered, having used `tokens`: take them from its pool's allowance."""
    if tokens <= 0 or not limits(key).tokens_per_minute:
        return
    with transaction.atomic():
        pool = state(key, now=now)
        pool.tokens_allowance -= tokens
        pool.save(update_fields=["requests_allowance", "tokens_allowance", "refilled_at"])


def pause(key: str, *, seconds: float, reason: str, now: datetime) -> tuple[datetime, bool]:
    """A provider answered 429 with Retry-After: nothing of the pool starts until then (at most MAX_PAUSE).
    Returns the end of the pause (a later pause already in force stands) and whether it is news: the
    caller tells the tasks waiting on the pool then (tell_waiting), once per pause, not once per call."""
    until = now + min(timedelta(seconds=max(0.0, seconds)), MAX_PAUSE)
    with transaction.atomic():
        pool = state(key, now=now)
        # A pause that ends within a second of the one in force is the same pause, told already.
        news = pool.paused_until is None or until > pool.paused_until + timedelta(seconds=1)
        pool.pauses += 1
        if pool.paused_until is None or until > pool.paused_until:
            pool.paused_until, pool.pause_reason = until, reason[:200]
        pool.save(update_fields=["requests_allowance", "tokens_allowance", "refilled_at", "paused_until",
                                 "pause_reason", "pauses"])
        until = pool.paused_until  # type: ignore[assignment]
    log.warning("pool %s paused until %s: %s", key, until.isoformat(), reason)
    return until, news


def tell_waiting(key: str, *, until: datetime, now: datetime, task_ids: Iterable[int] | None = None) -> None:
    """Tell the tasks waiting on a paused pool (or those given) what they wait for, each in its own short
    transaction (no other lock is held: the event's seq takes the task's row lock)."""
    from tasks.operations import waiting_on_pool

    ids = list(task_ids) if task_ids is not None else waiting_on_pool(key, limit=TELL_AT_MOST)
    data = {"pool": label(key), "kind": kind_of(key), "until": until.isoformat(), "reason": "rate_limited"}
    for task_id in ids:
        with transaction.atomic():
            task = Task.objects.filter(pk=task_id).first()
            if task is not None:
                events.append(task, [NewEvent(PAUSED, data)], status=task.status, at=now)


def paused_among(keys: Iterable[str], *, now: datetime) -> QuerySet[Pool, tuple[str, datetime]]:
    """Of these pools, those paused now, with when their pause ends: (key, paused_until) rows."""
    return Pool.objects.filter(key__in=set(keys), paused_until__gt=now).values_list("key", "paused_until")
