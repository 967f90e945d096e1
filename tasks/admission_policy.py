"""The admission rules themselves, without the database: who gets the next free slot and which submission
is refused. Live admission (tasks/scheduling.py) feeds them queue heads read from the database; the
replay (tasks/replay.py) feeds them heads from memory, so that what the replay shows is what the live
code would have done, not a second implementation of it.

The order (DESIGN §5, and tasks/scheduling.py's docstring for the reasons):
1. the tenant holding the fewest slots per unit of weight (weight 0: leftovers only);
2. among tenants tied there, the head with the highest effective priority
   (priority + one point per `aging_seconds` waited), then the oldest, then the lowest id;
3. within a tenant, a task queued only to cancel its remote work goes before any priority.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime
from fractions import Fraction
from typing import Protocol, TypeVar

from django.conf import settings

DEFAULT_AGING_SECONDS = 60.0


@dataclass(frozen=True)
class SystemPolicy:
    """The system-wide figures admission and backpressure decide by."""

    max_running: int
    max_queued: int
    aging_seconds: float
    shed_threshold: float


def system_policy() -> SystemPolicy:
    """The system's figures in force now, from the settings."""
    return SystemPolicy(max_running=settings.LONGHAUL_MAX_RUNNING, max_queued=settings.LONGHAUL_MAX_QUEUED,
                        aging_seconds=float(getattr(settings, "LONGHAUL_AGING_SECONDS", DEFAULT_AGING_SECONDS)),
                        shed_threshold=settings.LONGHAUL_SHED_THRESHOLD)


@dataclass(frozen=True)
class TenantPolicy:
    """One tenant's quotas."""

    weight: int
    max_running: int
    max_queued: int


@dataclass(frozen=True)
class Head:
    """A queued task as the chooser compares it."""

    id: int
    priority: int
    queued_at: datetime  # what waiting is measured from (Task.created_at)
    cancelling: bool = False  # queued only to cancel its remote work


class WaitingQueue(Protocol):
    """A tenant with queued tasks and a free slot of its own. `head` may be read lazily (live admission
    reads it from the database only when the tenant is a candidate) and is the same until it is taken."""

    tenant_id: int
    weight: int
    max_running: int
    running: int

    def head(self, *, now: datetime, aging_seconds: float) -> Head | None: ...


Q = TypeVar("Q", bound=WaitingQueue)


def effective_priority(priority: int, queued_at: datetime, *, now: datetime, aging_seconds: float) -> int:
    """Priority plus one point per aging period waited: nothing waits forever behind higher priority."""
    waited = max(0.0, (now - queued_at).total_seconds())
    return priority + int(waited // aging_seconds)


def rank(head: Head, *, now: datetime, aging_seconds: float) -> tuple[int, datetime, int]:
    """Sort key: highest effective priority first, then the oldest, then the lowest id."""
    return (-effective_priority(head.priority, head.queued_at, now=now, aging_seconds=aging_seconds),
            head.queued_at, head.id)


def best_head(candidates: Iterable[Head], *, now: datetime, aging_seconds: float) -> Head | None:
    """A tenant's next task among candidate heads: one queued to cancel first, else the best ranked."""
    heads = list(candidates)
    if not heads:
        return None
    return min(heads, key=lambda h: (not h.cancelling, rank(h, now=now, aging_seconds=aging_seconds)))


def share(queue: WaitingQueue | Holding) -> tuple[bool, Fraction]:
    """Slots held per unit of weight; weight 0 sorts after every weighted tenant."""
    return (queue.weight == 0, Fraction(queue.running, queue.weight or 1))


def next_queue(queues: list[Q], *, now: datetime, aging_seconds: float) -> Q | None:
    """The tenant furthest below its share, ties broken by its head's rank. Tenants found empty are
    dropped from `queues`. Heads are read only for tenants tied at the lowest share."""
    while queues:
        lowest = min(share(q) for q in queues)
        ready: list[tuple[Q, Head]] = []
        for queue in [q for q in queues if share(q) == lowest]:
            head = queue.head(now=now, aging_seconds=aging_seconds)
            if head is None:
                queues.remove(queue)  # emptied meanwhile, or (live) its rows are locked by a canceller
            else:
                ready.append((queue, head))
        if ready:
            return min(ready, key=lambda pair: rank(pair[1], now=now, aging_seconds=aging_seconds))[0]
    return None


def fill_slots(queues: list[Q], *, free: int, now: datetime, aging_seconds: float,
               take: Callable[[Q], bool]) -> None:
    """Give up to `free` slots, one at a time, each to the next queue's head. `take(queue)` admits that
    queue's head and reports whether it did; a queue whose head could not be taken is left alone."""
    while free > 0:
        queue = next_queue(queues, now=now, aging_seconds=aging_seconds)
        if queue is None:
            return
        if not take(queue):
            queues.remove(queue)
            continue
        queue.running += 1
        free -= 1
        if queue.running >= queue.max_running:
            queues.remove(queue)


@dataclass(frozen=True)
class Holding:
    """A tenant holding running slots, as taking one back compares it."""

    tenant_id: int
    weight: int
    running: int


def owes_a_slot(giver: Holding, taker: WaitingQueue) -> bool:
    """Whether moving one slot from `giver` to `taker` leaves the taker no richer per unit of weight
    than the giver: (taker.running + 1) / taker.weight <= (giver.running - 1) / giver.weight,
    cross-multiplied so that a giver of weight 0 (leftovers only) always owes, and a taker of
    weight 0 is never owed."""
    if taker.weight == 0 or giver.running < 1:
        return False
    return (taker.running + 1) * giver.weight <= (giver.running - 1) * taker.weight


def slot_to_take_back(queues: list[Q], holders: Iterable[Holding], *, now: datetime,
                      aging_seconds: float) -> tuple[Q, list[Holding]] | None:
    """With every slot taken: the waiting tenant furthest below its share (the one admission would
    serve next) and the other tenants that owe it one of their slots by the weights, furthest above
    their share first. A running slot is taken back at a step boundary (the issue "The hot path"):
    without it, a newcomer waits for a running task to end."""
    taker = next_queue(list(queues), now=now, aging_seconds=aging_seconds)
    if taker is None:
        return None
    givers = sorted((h for h in holders if h.tenant_id != taker.tenant_id and owes_a_slot(h, taker)),
                    key=share, reverse=True)
    return (taker, givers) if givers else None


# --- backpressure -----------------------------------------------------------------


@dataclass(frozen=True)
class Refusal:
    """Why a submission is refused: `rule` as QuotaExceeded.rule, with the figures it was refused by."""

    rule: str
    queued: int
    median: int | None = None


def refusal(tenant: TenantPolicy, system: SystemPolicy, *, priority: int, queued: int,
            median: Callable[[], int | None], system_queued: Callable[[], int]) -> Refusal | None:
    """The rule that refuses a submission of `priority` to a tenant with `queued` tasks waiting, if any.

    At the tenant's max_queued everything is refused; past LONGHAUL_SHED_THRESHOLD of it, a priority below
    the median of the tenant's own queue is (the places left go to its higher priorities); then the system
    cap. `median` and `system_queued` are asked only when needed (live, each is a query).
    """
    if queued >= tenant.max_queued:
        return Refusal("tenant_queue_full", queued)
    if queued >= tenant.max_queued * system.shed_threshold:
        middle = median()
        if middle is not None and priority < middle:
            return Refusal("shed_low_priority", queued, middle)
    if system_queued() >= system.max_queued:
        return Refusal("system_queue_full", queued)
    return None


def median_of_levels(levels: Iterable[tuple[int, int]]) -> int | None:
    """The median priority (the lower middle of an even count) from (priority, count) pairs in
    ascending priority."""
    pairs = list(levels)
    total = sum(n for _, n in pairs)
    seen = 0
    for level, n in pairs:
        seen += n
        if 2 * seen >= total and n:
            return level
    return None
