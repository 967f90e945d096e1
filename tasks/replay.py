"""Replay recorded admissions under another policy, in simulated time (manage.py replay_schedule).

The recorded arrivals of a window (AdmissionRecord, tasks/admission_records.py) go through the rules
live admission uses (tasks/admission_policy.py: the refusal rules at arrival, then fill_slots after
every arrival and every freed slot), with heads of queue kept in memory instead of read from the
database. Nothing runs and nothing sleeps: a replayed task holds its slot for as long as it held it in
reality (slot_released_at - admitted_at), and the clock jumps from one event to the next.

What the records cannot tell, and what the replay does instead:
- A task still holding its slot now holds it, in the replay, for as long as it has held it so far (a
  lower bound). A task never admitted in reality (still queued, or refused but accepted by the
  replay's policy) holds it for the median recorded duration of its tenant's tasks of its kind (else of
  its tenant, else of everyone), at most its wall-time budget. A task that ended while it was queued
  (cancelled, queue deadline) leaves the replay's queue at that moment, or, if the replay admitted it
  first, gives its slot back then.
- Only first admissions are replayed: a task resumed after a pause or an answer took a slot again in
  reality, which the replay does not see. Nor does it take slots back at step boundaries
  (LONGHAUL_TAKE_SLOTS_BACK): a task that gave its slot back shows as released then, and its second
  admission is not replayed.
- Tasks that arrived before the window and were still queued or holding a slot at its start are
  carried in as they were (queued since their arrival, or holding their slot until their recorded
  release); they compete but are not counted in the figures. Arrivals after the window are not
  replayed, and the replay goes on until every task of the window got a slot (or never can).
- Events at one moment are taken slots freed first, then tasks leaving the queue, then arrivals in
  the order they were recorded.
- The policy is one for the whole window: for each tenant the quotas of its latest record, for the
  system the figures of the latest record, each replaceable by an option.
"""

from __future__ import annotations

import bisect
import heapq
import math
import statistics
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any

from django.db.models import Q

from tasks import admission_policy as policy
from tasks.models import AdmissionRecord, Tenant

RELEASE, LEAVE, ARRIVE = 0, 1, 2  # the order of events at one moment


@dataclass(frozen=True)
class Overrides:
    """The policy to replay under, where it differs from the recorded one."""

    weights: dict[str, int] = field(default_factory=dict)  # tenant slug -> weight
    max_running: int | None = None  # the system's cap (LONGHAUL_MAX_RUNNING)
    aging_seconds: float | None = None


@dataclass(frozen=True)
class Policy:
    """The policy of a whole replay."""

    system: policy.SystemPolicy
    tenants: dict[int, policy.TenantPolicy]


@dataclass
class Admission:
    """One admission, replayed or recorded: which record, and when."""

    record_id: int
    task_id: int | None
    tenant_id: int
    at: datetime


@dataclass
class Figures:
    """What one tenant saw on one side (replayed or actual)."""

    waits: list[float] = field(default_factory=list)  # seconds from arrival to first admission
    refused: Counter[str] = field(default_factory=Counter)  # by rule
    not_admitted: int = 0
    slot_seconds: float = 0.0

    def as_dict(self, *, total_slot_seconds: float) -> dict[str, Any]:
        return {"admitted": len(self.waits), "wait_p50": percentile(self.waits, 50),
                "wait_p95": percentile(self.waits, 95), "wait_max": max(self.waits) if self.waits else None,
                "slot_share": round(self.slot_seconds / total_slot_seconds, 4) if total_slot_seconds else None,
                "refused": sum(self.refused.values()), "refused_by_rule": dict(sorted(self.refused.items())),
                "not_admitted": self.not_admitted}


@dataclass
class Report:
    start: datetime
    end: datetime
    policy: Policy
    recorded_policy: Policy
    slugs: dict[int, str]
    arrivals: int
    replayed: dict[int, Figures]
    actual: dict[int, Figures]
    replayed_order: list[Admission]
    actual_order: list[Admission]

    def as_dict(self) -> dict[str, Any]:
        replayed_total = sum(f.slot_seconds for f in self.replayed.values())
        actual_total = sum(f.slot_seconds for f in self.actual.values())
        return {
            "from": self.start.isoformat(), "to": self.end.isoformat(), "arrivals": self.arrivals,
            "policy": {"replayed": self._policy_dict(self.policy), "recorded": self._policy_dict(self.recorded_policy)},
            "tenants": {
                self.slugs[tenant_id]: {
                    "replayed": self.replayed[tenant_id].as_dict(total_slot_seconds=replayed_total),
                    "actual": self.actual[tenant_id].as_dict(total_slot_seconds=actual_total),
                }
                for tenant_id in sorted(self.slugs, key=self.slugs.__getitem__)
            },
        }

    def _policy_dict(self, chosen: Policy) -> dict[str, Any]:
        return {"max_running": chosen.system.max_running, "max_queued": chosen.system.max_queued,
                "aging_seconds": chosen.system.aging_seconds, "shed_threshold": chosen.system.shed_threshold,
                "tenants": {self.slugs[t]: {"weight": p.weight, "max_running": p.max_running,
                                            "max_queued": p.max_queued}
                            for t, p in sorted(chosen.tenants.items(), key=lambda item: self.slugs[item[0]])}}


def percentile(values: list[float], p: int) -> float | None:
    """The nearest-rank percentile, in seconds rounded to milliseconds."""
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)], 3)


# --- the recorded side ---------------------------------------------------------------


@dataclass(frozen=True)
class Item:
    """One recorded submission, as the replay needs it."""

    record: AdmissionRecord
    in_window: bool

    @property
    def head(self) -> policy.Head:
        return policy.Head(id=self.record.task_id or -self.record.pk, priority=self.record.priority,
                           queued_at=self.record.arrived_at)


def load(start: datetime, end: datetime) -> tuple[list[Item], list[Item]]:
    """The window's arrivals and refusals, and the tasks carried into it (queued or holding a slot at its
    start), each in the order recorded."""
    window = AdmissionRecord.objects.filter(arrived_at__gte=start, arrived_at__lt=end).order_by("arrived_at", "id")
    holding = Q(admitted_at__lt=start) & (Q(slot_released_at__isnull=True) | Q(slot_released_at__gte=start))
    waiting = ((Q(admitted_at__isnull=True) | Q(admitted_at__gte=start))
               & (Q(finished_at__isnull=True) | Q(finished_at__gte=start)))
    carried = (AdmissionRecord.objects.filter(arrived_at__lt=start, refused=False).filter(holding | waiting)
               .order_by("arrived_at", "id"))
    return [Item(r, True) for r in window], [Item(r, False) for r in carried]


def recorded_policy(items: Iterable[Item]) -> Policy:
    """Each tenant's quotas from its latest record, the system's figures from the latest record."""
    tenants: dict[int, policy.TenantPolicy] = {}
    system = policy.system_policy()
    for item in sorted(items, key=lambda i: (i.record.arrived_at, i.record.pk)):
        r = item.record
        tenants[r.tenant_id] = policy.TenantPolicy(r.weight, r.max_running, r.max_queued)
        system = policy.SystemPolicy(r.system_max_running, r.system_max_queued, r.aging_seconds, r.shed_threshold)
    return Policy(system, tenants)


def apply(recorded: Policy, overrides: Overrides, slugs: dict[str, int]) -> Policy:
    """The recorded policy with the overrides; `slugs` maps every override's tenant slug to its id."""
    system = recorded.system
    if overrides.max_running is not None:
        system = replace(system, max_running=overrides.max_running)
    if overrides.aging_seconds is not None:
        system = replace(system, aging_seconds=overrides.aging_seconds)
    tenants = dict(recorded.tenants)
    for slug, weight in overrides.weights.items():
        tenant_id = slugs[slug]
        if tenant_id in tenants:
            tenants[tenant_id] = replace(tenants[tenant_id], weight=weight)
    return Policy(system, tenants)


def actual_figures(items: list[Item], *, start: datetime, end: datetime, now: datetime) -> dict[int, Figures]:
    figures: dict[int, Figures] = defaultdict(Figures)
    for item in items:
        r = item.record
        if item.in_window:
            side = figures[r.tenant_id]
            if r.refused:
                side.refused[r.rule] += 1
            elif r.admitted_at is None:
                side.not_admitted += 1
            else:
                side.waits.append((r.admitted_at - r.arrived_at).total_seconds())
        if r.admitted_at is not None:
            figures[r.tenant_id].slot_seconds += _overlap(r.admitted_at, r.slot_released_at or now, start, end)
    return figures


def actual_order(items: list[Item], *, start: datetime) -> list[Admission]:
    """Recorded first admissions from the window's start, in the order they happened (ties: by record)."""
    admitted = [i.record for i in items if i.record.admitted_at is not None and i.record.admitted_at >= start]
    admitted.sort(key=lambda r: (r.admitted_at, r.pk))
    return [Admission(r.pk, r.task_id, r.tenant_id, r.admitted_at) for r in admitted]  # type: ignore[arg-type]


def _overlap(begin: datetime, finish: datetime, start: datetime, end: datetime) -> float:
    return max(0.0, (min(finish, end) - max(begin, start)).total_seconds())


# --- the simulation ----------------------------------------------------------------


@dataclass
class SimulatedQueue:
    """One tenant in the replay: a policy.WaitingQueue whose heads are in memory. Queued items are kept
    per priority level, oldest first, like task_queued_idx: a level's first is its head."""

    tenant_id: int
    weight: int
    max_running: int
    max_queued: int
    running: int = 0
    levels: dict[int, list[Item]] = field(default_factory=dict)
    queued: int = 0

    def head(self, *, now: datetime, aging_seconds: float) -> policy.Head | None:
        return policy.best_head((level[0].head for level in self.levels.values() if level), now=now,
                                aging_seconds=aging_seconds)

    def add(self, item: Item) -> None:
        bisect.insort(self.levels.setdefault(item.record.priority, []), item,
                      key=lambda i: (i.record.arrived_at, i.head.id))
        self.queued += 1

    def remove(self, item: Item) -> bool:
        level = self.levels.get(item.record.priority, [])
        if item not in level:
            return False
        level.remove(item)
        self.queued -= 1
        return True

    def pop(self, head: policy.Head) -> Item:
        level = self.levels[head.priority]
        item = level.pop(0)
        assert item.head == head
        self.queued -= 1
        return item

    def median(self) -> int | None:
        return policy.median_of_levels(sorted((p, len(level)) for p, level in self.levels.items()))


class Simulation:
    """Discrete events over simulated time: arrivals, tasks leaving the queue, slots freed."""

    def __init__(self, chosen: Policy, items: list[Item], carried: list[Item], *, start: datetime,
                 now: datetime) -> None:
        self.policy = chosen
        self.now = now  # the real time of the replay: how long a task still holding its slot has held it
        self.events: list[tuple[datetime, int, int, Item]] = []
        self.seq = 0
        self.queues = {t: SimulatedQueue(t, p.weight, p.max_running, p.max_queued) for t, p in chosen.tenants.items()}
        self.running = 0
        self.admitted: dict[int, Admission] = {}  # by record id
        self.refused: list[tuple[Item, str]] = []
        self.holds: list[tuple[int, datetime, datetime]] = []  # tenant, from, to
        self.durations = _known_durations([*carried, *items], now=now)
        for item in carried:
            r = item.record
            if r.admitted_at is not None and r.admitted_at < start:  # holding its slot, as it was
                self.queues[r.tenant_id].running += 1
                self.running += 1
                released = r.slot_released_at or now
                self.holds.append((r.tenant_id, r.admitted_at, released))
                self._push(released, RELEASE, item)
            else:
                self._push(r.arrived_at, ARRIVE, item)
        for item in items:
            self._push(item.record.arrived_at, ARRIVE, item)

    def _push(self, at: datetime, kind: int, item: Item) -> None:
        self.seq += 1
        heapq.heappush(self.events, (at, kind, self.seq, item))

    def run(self) -> None:
        while self.events:
            at, kind, _, item = heapq.heappop(self.events)
            if kind == ARRIVE:
                self._arrive(item, at)
            elif kind == LEAVE:
                self.queues[item.record.tenant_id].remove(item)  # no slot freed: nothing to admit
            else:
                self.queues[item.record.tenant_id].running -= 1
                self.running -= 1
                self._admit(at)

    def _arrive(self, item: Item, at: datetime) -> None:
        r = item.record
        queue = self.queues[r.tenant_id]
        if item.in_window:
            total = sum(q.queued for q in self.queues.values())
            refused = policy.refusal(self.policy.tenants[r.tenant_id], self.policy.system, priority=r.priority,
                                     queued=queue.queued, median=queue.median, system_queued=lambda: total)
            if refused is not None:
                self.refused.append((item, refused.rule))
                return
        queue.add(item)
        if r.admitted_at is None and r.finished_at is not None:
            self._push(r.finished_at, LEAVE, item)  # it ended while queued: it leaves then, if still queued
        self._admit(at)

    def _admit(self, now: datetime) -> None:
        waiting = [q for _, q in sorted(self.queues.items()) if q.queued and q.running < q.max_running]

        def take(queue: SimulatedQueue) -> bool:
            head = queue.head(now=now, aging_seconds=self.policy.system.aging_seconds)
            assert head is not None
            item = queue.pop(head)
            r = item.record
            self.admitted[r.pk] = Admission(r.pk, r.task_id, r.tenant_id, now)
            released = now + self._duration(item, admitted_at=now)
            self.holds.append((r.tenant_id, now, released))
            self._push(released, RELEASE, item)
            self.running += 1  # fill_slots counts the tenant's
            return True

        policy.fill_slots(waiting, free=self.policy.system.max_running - self.running, now=now,
                          aging_seconds=self.policy.system.aging_seconds, take=take)

    def _duration(self, item: Item, *, admitted_at: datetime) -> timedelta:
        r = item.record
        if r.admitted_at is not None:
            return (r.slot_released_at or self.now) - r.admitted_at
        if r.finished_at is not None:  # it ended while queued in reality: it would have stopped then
            return max(timedelta(0), r.finished_at - admitted_at)
        guess = (self.durations.get((r.tenant_id, r.kind)) or self.durations.get((r.tenant_id, None))
                 or self.durations.get((None, None)) or 0.0)
        return timedelta(seconds=min(guess, r.max_wall_seconds))

    def figures(self, items: list[Item], *, start: datetime, end: datetime) -> dict[int, Figures]:
        figures: dict[int, Figures] = defaultdict(Figures)
        for item, rule in self.refused:
            figures[item.record.tenant_id].refused[rule] += 1
        refused = {item.record.pk for item, _ in self.refused}
        for item in items:
            r = item.record
            side = figures[r.tenant_id]
            if r.pk in refused:
                continue
            if r.pk in self.admitted:
                side.waits.append((self.admitted[r.pk].at - r.arrived_at).total_seconds())
            else:
                side.not_admitted += 1
        for tenant_id, begin, finish in self.holds:
            figures[tenant_id].slot_seconds += _overlap(begin, finish, start, end)
        return figures

    def order(self) -> list[Admission]:
        return sorted(self.admitted.values(), key=lambda a: a.at)  # stable: ties keep the order admitted


def _known_durations(items: list[Item], *, now: datetime) -> dict[tuple[int | None, str | None], float]:
    """Median slot-holding seconds of recorded admissions, by (tenant, kind), by tenant, and overall."""
    samples: dict[tuple[int | None, str | None], list[float]] = defaultdict(list)
    for item in items:
        r = item.record
        if r.admitted_at is not None and r.slot_released_at is not None:
            seconds = (r.slot_released_at - r.admitted_at).total_seconds()
            for key in ((r.tenant_id, r.kind), (r.tenant_id, None), (None, None)):
                samples[key].append(seconds)
    return {key: statistics.median(values) for key, values in samples.items()}


def replay(start: datetime, end: datetime, overrides: Overrides, *, now: datetime) -> Report:
    """Replay the window [start, end) under the recorded policy with `overrides`; the tenants named in
    `overrides.weights` must exist (the command checks)."""
    items, carried = load(start, end)
    recorded = recorded_policy([*items, *carried])
    tenant_ids = set(recorded.tenants)
    slug_ids = dict(Tenant.objects.filter(slug__in=list(overrides.weights)).values_list("slug", "pk"))
    chosen = apply(recorded, overrides, slug_ids)
    simulation = Simulation(chosen, items, carried, start=start, now=now)
    simulation.run()
    slugs = dict(Tenant.objects.filter(pk__in=tenant_ids).values_list("pk", "slug"))
    replayed = simulation.figures(items, start=start, end=end)
    actual = actual_figures([*items, *carried], start=start, end=end, now=now)
    return Report(start=start, end=end, policy=chosen, recorded_policy=recorded, slugs=slugs, arrivals=len(items),
                  replayed={t: replayed[t] for t in tenant_ids}, actual={t: actual[t] for t in tenant_ids},
                  replayed_order=simulation.order(), actual_order=actual_order([*items, *carried], start=start))


def render(report: Report) -> str:
    """The report as a table, one row per tenant, each figure as replayed / actual."""
    data = report.as_dict()
    replayed_policy = data["policy"]["replayed"]
    weights = ", ".join(f"{slug}={p['weight']}" for slug, p in replayed_policy["tenants"].items()) or "none"
    lines = [
        f"Replay of {data['from']} to {data['to']}: {data['arrivals']} arrivals.",
        (f"Policy replayed: max running {replayed_policy['max_running']}, "
         f"aging {replayed_policy['aging_seconds']:g} s, weights {weights}."),
        "Each cell: replayed / actual. Waits in seconds, from arrival to first admission.",
        "",
    ]
    header = ("tenant", "wait p50", "wait p95", "wait max", "slot share", "refused", "not admitted")
    rows = [header]
    for slug, sides in data["tenants"].items():
        replayed, actual = sides["replayed"], sides["actual"]
        rows.append((slug, *(f"{_cell(replayed[k])} / {_cell(actual[k])}"
                             for k in ("wait_p50", "wait_p95", "wait_max", "slot_share", "refused", "not_admitted"))))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines += ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows]
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}".rstrip("0").rstrip(".") if value else "0"
    return str(value)
