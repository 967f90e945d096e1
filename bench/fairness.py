"""Fairness under a flood: two tenants with equal weights, one submitting 100 tasks for each of the
other's, on 4 running slots, executed by a real qcluster; beside an idle system's admission wait
for the light tenant alone, in one run on this machine.

    DATABASE_URL=postgres://longhaul:longhaul@127.0.0.1:5432/longhaul_h5bench .venv/bin/python bench/fairness.py

Phases, all with sleep tasks of STEPS steps of STEP_SECONDS each:
  1. idle baseline: the light tenant submits tasks one at a time on an empty system;
  2. flood: the heavy tenant submits 100x the light tenant's total, keeping every slot busy;
  3. trickle: the light tenant submits single tasks, each after the previous one finished (it
     holds no slot: admission asks one of the heavy tenant's running tasks to give its slot back,
     which it does at its next step boundary, LONGHAUL_TAKE_SLOTS_BACK; without that the newcomer
     waited for one of the 4 running tasks to end, about 1.6 step-times at p95 with 3-step tasks);
  4. burst: once the light tenant holds no slot, it submits a batch at once: both tenants are
     backlogged until the batch's last task is admitted; slot-time shares are measured there.
Targets: the light tenant's p95 wait under the flood within 2 step-times (measured, checkpoint to
checkpoint) of the idle baseline's, and slot-time shares within 10% (relative) of the weights
while both had tasks waiting for a slot.

Pools (--part pools, run after the admission phases by default): the gateway, in this process,
runs SEARCHES search calls for 25 tasks, first alone (the baseline), then beside MODEL_CALLS model
calls to a loopback OpenAI-compatible fake whose pool is rate-limited (MODEL_RPM requests/min) and
paused once by a 429 with Retry-After; against a loopback SearxNG-style search API answering after
SEARCH_DELAY_S, then against the offline corpus. Target (the search API's): the searches keep
their pace, their p95 wait (due to started) within one gateway turn (250 ms) of the baseline's.
The corpus's searches are this process's CPU (SQLite full-text search), so their pace is the
CPU's, which the model calls beside them share: reported, without a target.

Migrates DATABASE_URL first (bench/_harness.py), refuses a database with unfinished tasks of
others (the system cap would be shared with them), creates its own tenants, user and tasks, and
deletes them afterwards. Loopback only; bounded in time (--timeout a phase) and count.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import _harness as h
from django.conf import settings
from django.db import connection, transaction

from tasks import actions, clock, scheduling
from tasks.budgets import Budget
from tasks.drivers import get_driver
from tasks.models import Checkpoint, Task, TaskEvent, Tenant
from tasks.statuses import TERMINAL, TaskStatus

SLOTS = 4
STEPS = 3
STEP_SECONDS = 0.05
RATIO = 100
SHARE_TOLERANCE = 0.10  # relative to the weight share
LOOPBACK = {"127.0.0.1", "localhost", "::1", ""}
LIMITS = {"idle": 100, "trickle": 100, "burst": 100, "timeout": 600}
Interval = tuple[datetime, datetime]


@dataclass
class Phase:
    started: datetime
    ended: datetime


@dataclass
class Tenants:
    heavy: h.Scope
    light: h.Scope


# --- driving the run --------------------------------------------------------------


def submit(scope: h.Scope) -> int:
    task, _ = actions.submit(tenant=scope.tenant, user=scope.user, submission=actions.Submission(
        kind="sleep", input={"steps": STEPS, "step_seconds": STEP_SECONDS}))
    return task.pk


def phase(run: Callable[[], None]) -> Phase:
    started = clock.now()
    run()
    return Phase(started, clock.now())


def wait_finished(ids: Iterable[int], timeout: float) -> None:
    ids = list(ids)
    h.wait_until(lambda: not Task.objects.filter(pk__in=ids).exclude(status__in=TERMINAL).exists(),
                 timeout=timeout, interval=0.01, message=f"{len(ids)} tasks to end")


def idle_baseline(light: h.Scope, count: int, timeout: float) -> None:
    """The light tenant alone: one task at a time, each finished before the next."""
    for _ in range(count):
        wait_finished([submit(light)], timeout)


def flood(heavy: h.Scope, count: int) -> None:
    """The heavy tenant's submissions, written in bulk: the rows and 'queued' events actions.submit
    writes, then one admission, as the last submission would do. One transaction per submission
    would take minutes on a loaded 2-core machine without changing what is measured; the light
    tenant, whose waits are the point, always submits through actions.submit."""
    driver = get_driver("sleep")
    task_input = driver.validate_input({"steps": STEPS, "step_seconds": STEP_SECONDS})
    budget = Budget.parse(None)
    at = clock.now()
    with transaction.atomic():
        tasks = Task.objects.bulk_create(
            Task(tenant=heavy.tenant, owner=heavy.user, kind="sleep", name="sleep task", input=task_input,
                 budget=budget.as_dict(), status=TaskStatus.QUEUED, created_at=at, updated_at=at,
                 queue_deadline_at=at + timedelta(seconds=budget.queue_deadline_seconds),
                 code_version=settings.LONGHAUL_CODE_VERSION, schema_version=driver.schema_version,
                 last_event_seq=1)
            for _ in range(count)
        )
        TaskEvent.objects.bulk_create(
            TaskEvent(task=task, tenant=heavy.tenant, seq=1, kind="queued", status=TaskStatus.QUEUED,
                      data={"kind": "sleep"}, at=at)
            for task in tasks
        )
        scheduling.admit(now=at)


def trickle(light: h.Scope, count: int, timeout: float) -> None:
    """Single light tasks, each submitted once the previous one finished."""
    for i in range(count):
        wait_finished([submit(light)], timeout)
        time.sleep(STEP_SECONDS * (i % 5) / 5)  # arrive at a different point of the others' steps


def burst(light: h.Scope, count: int, timeout: float) -> None:
    """A batch of light tasks at once, submitted when the light tenant holds no slot."""
    ids = [submit(light) for _ in range(count)]
    h.wait_until(lambda: not Task.objects.filter(pk__in=ids, status=TaskStatus.QUEUED).exists(),
                 timeout=timeout, interval=0.01, message="the burst to be admitted")


# --- measuring from the database ----------------------------------------------------


def waits(tenant: Tenant, during: Phase) -> list[float]:
    """Admission waits (ms) of the tenant's tasks submitted during the phase."""
    rows = TaskEvent.objects.filter(kind="admitted", tenant=tenant, task__created_at__gte=during.started,
                                    task__created_at__lte=during.ended).values_list("at", "task__created_at")
    return [(at - created).total_seconds() * 1000 for at, created in rows]


def step_times(tenant: Tenant, during: Phase) -> list[float]:
    """Wall time (ms) between consecutive checkpoints of one task, within the phase."""
    gaps: list[float] = []
    last: dict[int, datetime] = {}
    rows = (Checkpoint.objects.filter(task__tenant=tenant, at__gte=during.started, at__lte=during.ended)
            .order_by("task_id", "step").values_list("task_id", "at"))
    for task_id, at in rows:
        if task_id in last:
            gaps.append((at - last[task_id]).total_seconds() * 1000)
        last[task_id] = at
    return gaps


def slot_intervals(tenant: Tenant, end_of_run: datetime) -> list[Interval]:
    """[admitted, finished) of each of the tenant's tasks: the time it held a slot."""
    admitted = dict(TaskEvent.objects.filter(kind="admitted", tenant=tenant).values_list("task_id", "at"))
    finished = dict(Task.objects.filter(tenant=tenant, finished_at__isnull=False).values_list("pk", "finished_at"))
    return [(at, finished.get(task_id, end_of_run)) for task_id, at in admitted.items()]


def queued_intervals(tenant: Tenant, end_of_run: datetime) -> list[Interval]:
    """[created, admitted) of each of the tenant's tasks; still-queued ones up to the end of the run."""
    rows = TaskEvent.objects.filter(kind="admitted", tenant=tenant).values_list("task__created_at", "at")
    waiting = Task.objects.filter(tenant=tenant, status=TaskStatus.QUEUED).values_list("created_at", flat=True)
    return [*rows, *((created, end_of_run) for created in waiting)]


def union(intervals: Iterable[Interval]) -> list[Interval]:
    merged: list[Interval] = []
    for start, end in sorted(i for i in intervals if i[1] > i[0]):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def intersect(a: list[Interval], b: list[Interval]) -> list[Interval]:
    return [(max(s1, s2), min(e1, e2)) for s1, e1 in a for s2, e2 in b if min(e1, e2) > max(s1, s2)]


def overlap(intervals: Iterable[Interval], windows: list[Interval]) -> float:
    return sum((min(e, we) - max(s, ws)).total_seconds()
               for s, e in intervals for ws, we in windows if min(e, we) > max(s, ws))


def slot_seconds(tenants: Tenants, during: Phase) -> tuple[dict[str, float], float]:
    """Each tenant's slot-seconds while both had tasks waiting for a slot within the phase, and
    how long that was."""
    end = clock.now()
    both = intersect(intersect(union(queued_intervals(tenants.heavy.tenant, end)),
                               union(queued_intervals(tenants.light.tenant, end))),
                     [(during.started, during.ended)])
    used = {name: overlap(slot_intervals(scope.tenant, end), both)
            for name, scope in (("heavy", tenants.heavy), ("light", tenants.light))}
    return used, sum((e - s).total_seconds() for s, e in both)


# --- the benchmark ------------------------------------------------------------------


def check_database() -> None:
    host = str(settings.DATABASES["default"].get("HOST") or "")
    if host not in LOOPBACK:
        raise SystemExit(f"bench/fairness.py runs against a loopback database only (got {host!r})")
    for tenant in Tenant.objects.filter(slug__startswith="bench-fairness-"):  # an earlier run killed mid-way
        users = tenant.memberships.filter(user__username__startswith="bench-").values_list("user_id", flat=True)
        h.purge_tenant(tenant.pk, list(users))
    busy = Task.objects.exclude(status__in=TERMINAL).count()
    if busy:
        raise SystemExit(f"the database has {busy} unfinished tasks; use a database of its own for this bench")


def run(*, idle: int = 8, trickle_count: int = 30, burst_count: int = 20, timeout: float = 300,
        part: str = "all") -> h.Report:
    h.migrate_if_needed()
    check_database()
    if part == "pools":
        report = h.Report("fairness", "Fair pools", "The gateway's pools (see the Pools section).")
        run_pools(report, timeout=timeout)
        return report
    flood_count = RATIO * (trickle_count + burst_count)
    report = h.Report(
        "fairness", "Fair admission under a flood",
        f"Two tenants with equal weights on {SLOTS} running slots, sleep tasks of {STEPS} x "
        f"{STEP_SECONDS * 1000:.0f} ms, through a qcluster of {SLOTS} workers: the heavy tenant submits "
        f"{flood_count} tasks ({RATIO}:1), the light one {trickle_count} singly and then {burst_count} at once; "
        f"beside the light tenant alone on an idle system ({idle} tasks). Waits from the events "
        f"(admitted.at - created_at).",
    )
    tenants = Tenants(heavy=h.Scope.create("fairness-heavy", max_running=SLOTS),
                      light=h.Scope.create("fairness-light", max_running=SLOTS))
    phases: dict[str, Phase] = {}
    try:
        with h.override(LONGHAUL_MAX_RUNNING=SLOTS):  # this process admits at submission, under the same cap
            with h.qcluster("fairness", workers=SLOTS, LONGHAUL_MAX_RUNNING=str(SLOTS)):
                phases["idle"] = phase(lambda: idle_baseline(tenants.light, idle, timeout))
                phases["flood"] = phase(lambda: flood(tenants.heavy, flood_count))
                phases["trickle"] = phase(lambda: trickle(tenants.light, trickle_count, timeout))
                wait_finished(Task.objects.filter(tenant=tenants.light.tenant).values_list("pk", flat=True), timeout)
                phases["burst"] = phase(lambda: burst(tenants.light, burst_count, timeout))
            describe(report, tenants, phases)
    finally:
        tenants.heavy.purge()
        tenants.light.purge()
    if part == "all":
        run_pools(report, timeout=timeout)
    return report


def describe(report: h.Report, tenants: Tenants, phases: dict[str, Phase]) -> None:
    """Fill the report from the run's events and checkpoints."""
    light, heavy = tenants.light.tenant, tenants.heavy.tenant
    idle = waits(light, phases["idle"])
    trickled = waits(light, phases["trickle"])
    steps = step_times(heavy, Phase(phases["flood"].started, phases["burst"].ended))
    step_ms = h.median(steps)
    rows = [
        ["light, idle system (baseline)", *_summary(idle)],
        ["light, singly under the flood", *_summary(trickled)],
        ["light, its own burst", *_summary(waits(light, phases["burst"]))],
        ["heavy, flood (those admitted by the end)", *_summary(waits(heavy, phases["flood"]))],
    ]
    report.add("Admission wait (ms)", h.table(["who", "n", "p50", "p95", "max"], rows)
               + f"\n\nStep time (checkpoint to checkpoint, heavy tenant, under load): median "
                 f"{h.fmt(step_ms)} ms, p95 {h.fmt(h.percentile(steps, 95))} ms over {len(steps)} steps.")
    used, window = slot_seconds(tenants, phases["burst"])
    total = sum(used.values()) or 1.0
    share = {name: seconds / total for name, seconds in used.items()}
    report.add("Slot-time while both tenants had tasks waiting for a slot", h.table(
        ["tenant", "slot-seconds", "share", "weight share"],
        [[name, h.fmt(used[name], 2), f"{share[name]:.1%}", "50.0%"] for name in ("heavy", "light")])
        + f"\n\nBoth were backlogged for {window:.2f} s, from the light tenant's burst (holding no slot) to its "
          f"last admission.")
    bound = h.percentile(idle, 95) + 2 * step_ms
    report.targets += [
        h.Target("light tenant's p95 wait under the flood within 2 step-times of the idle baseline",
                 f"{h.fmt(h.percentile(trickled, 95))} ms vs {h.fmt(h.percentile(idle, 95))} + 2 x "
                 f"{h.fmt(step_ms)} = {h.fmt(bound)} ms", h.percentile(trickled, 95) <= bound),
        h.Target(f"slot-time shares within {SHARE_TOLERANCE:.0%} of the weights while both have work",
                 ", ".join(f"{name} {share[name]:.1%}" for name in ("heavy", "light")),
                 window > 0 and all(abs(s - 0.5) <= 0.5 * SHARE_TOLERANCE for s in share.values())),
    ]
    if connection.vendor != "postgresql":
        report.notes.append("not PostgreSQL: the figures do not describe the production mode")


# --- pools: a rate-limited model pool beside the searches --------------------------------

SEARCHES = 200
MODEL_CALLS = 200
MODEL_RPM = 60
MODEL_KEY = "model:openai:fake-model"
PAUSE_S = 2
SEARCH_DELAY_S = 0.5  # the loopback search API's answer time


def _waiting_tasks(scope: h.Scope, count: int) -> list[Task]:
    now = clock.now()
    return [Task.objects.create(tenant=scope.tenant, owner=scope.user, kind="research", name="pools", input={},
                                budget={}, status=TaskStatus.WAITING_TOOL, current_step=1, created_at=now,
                                updated_at=now, started_at=now) for _ in range(count)]


def _calls(tasks: list[Task], total: int, *, kind: str, name: str, tag: str) -> list[int]:
    from tasks.drivers import OpRequest
    from tasks.models import Operation
    from tasks.operations import request

    per_task = max(1, total // len(tasks))
    with transaction.atomic():
        for task in tasks:
            args = [{"query": f"asyncio {tag} {task.pk} {n}", "limit": 3} if kind == "tool"
                    else {"question": f"q {task.pk} {n}", "constraints": "", "max_subquestions": 2}
                    for n in range(per_task)]
            request(task, token=0, now=clock.now(), step=0, requests=[OpRequest(kind, name, a) for a in args])
    return list(Operation.objects.filter(task__in=tasks, kind=kind).values_list("pk", flat=True))


def _gateway_until_done(op_ids: list[int], timeout: float) -> float:
    """Run gateway jobs in this process until these calls have all finished; seconds taken. Each job runs
    as a worker's does, for the default slice or until it has no call out and none it may start (the rate-
    limited model calls left wait for their allowance, and the job ends between two of them)."""
    from tasks import operations
    from tasks.models import Operation

    started = time.monotonic()
    while Operation.objects.filter(pk__in=op_ids).exclude(status__in=operations.FINISHED).exists():
        if time.monotonic() - started > timeout:
            raise SystemExit(f"pools: the calls did not finish within {timeout:g} s")
        operations.run_due()
    return time.monotonic() - started


def _waits_ms(op_ids: list[int]) -> list[float]:
    from tasks.models import Operation

    rows = Operation.objects.filter(pk__in=op_ids, started_at__isnull=False).values_list("created_at", "started_at")
    return [(started - created).total_seconds() * 1000 for created, started in rows]


@dataclass
class PoolsRun:
    """One backend's searches, alone and beside the rate-limited model pool."""
    alone: list[float]  # waits, ms
    beside: list[float]
    alone_rate: float  # searches/s
    beside_rate: float
    model_done: int
    models: int
    pauses: int
    requests: int


def _searches_beside_models(scope: h.Scope, fake: Any, *, timeout: float) -> PoolsRun:
    """Searches alone, then beside a model pool its provider rate-limits and pauses once."""
    from tasks.models import Operation, Pool
    from tests.fakes.openai_server import Status

    Pool.objects.filter(key=MODEL_KEY).delete()
    requests_before = fake.request_count
    try:
        # Unmeasured: the process's first gateway job and first searches pay what is paid once (imports, the
        # TLS context, the corpus's first read), which would fall on the baseline alone.
        _gateway_until_done(_calls(_waiting_tasks(scope, 2), 8, kind="tool", name="search", tag="warm"), timeout)
        alone = _calls(_waiting_tasks(scope, 25), SEARCHES, kind="tool", name="search", tag="alone")
        alone_s = _gateway_until_done(alone, timeout)
        fake.script(Status(429, headers={"Retry-After": str(PAUSE_S)}))
        models = _calls(_waiting_tasks(scope, 50), MODEL_CALLS, kind="model", name="plan", tag="m")
        beside = _calls(_waiting_tasks(scope, 25), SEARCHES, kind="tool", name="search", tag="beside")
        beside_s = _gateway_until_done(beside, timeout)
        model_done = Operation.objects.filter(pk__in=models, status__in=("succeeded", "failed")).count()
        pool = Pool.objects.get(key=MODEL_KEY)
        return PoolsRun(_waits_ms(alone), _waits_ms(beside), len(alone) / alone_s, len(beside) / beside_s,
                        model_done, len(models), pool.pauses, fake.request_count - requests_before)
    finally:
        Pool.objects.filter(key=MODEL_KEY).delete()
        ids = set(Task.objects.filter(tenant=scope.tenant).values_list("pk", flat=True))
        # Before the tasks go (the scope's purge finds its kicks through them): theirs, and the gateway's delayed
        # kicks (argument 0) that jobs left for the model calls held back by their pool.
        h.purge_kicks(ids, set(), task_arg_zero=True)
        Task.objects.filter(pk__in=ids).delete()


def run_pools(report: h.Report, *, timeout: float) -> None:
    """Searches alone, then beside a rate-limited and paused model pool, against a remote search API (the
    target) and against the offline corpus (for reference); every row made is deleted."""
    from tests.fakes.http_site import HttpSite
    from tests.fakes.openai_server import FakeOpenAI, Reply, research_reply

    scope = h.Scope.create("fairness-pools")
    runs: dict[str, PoolsRun] = {}
    try:
        with FakeOpenAI(default=Reply(content=research_reply, delay=0.2)) as fake, HttpSite() as site, h.override(
                LONGHAUL_MODEL_PROVIDER="openai", LONGHAUL_MODEL_BASE_URL=fake.base_url, LONGHAUL_MODEL="fake-model",
                LONGHAUL_POOLS={MODEL_KEY: {"requests_per_minute": MODEL_RPM}},
                # One turn: a job ends once it has no call out and none it may start (with more, it would keep its
                # turn for the whole slice, and each _gateway_until_done would last a minute at least).
                LONGHAUL_GATEWAY_TURNS=1):
            with h.override(LONGHAUL_SEARCH_URL=f"{site.url}/search?delay={SEARCH_DELAY_S:g}"):
                runs["web"] = _searches_beside_models(scope, fake, timeout=timeout)
            with h.override(LONGHAUL_SEARCH_URL=""):
                runs["corpus"] = _searches_beside_models(scope, fake, timeout=timeout)
    finally:
        scope.purge()
    rows = []
    for backend, label in (("web", f"a loopback search API answering after {SEARCH_DELAY_S * 1000:,.0f} ms"),
                           ("corpus", "the offline corpus (in this process)")):
        r = runs[backend]
        rows += [[label, "alone (baseline)", *_summary(r.alone), h.fmt(r.alone_rate)],
                 [label, f"beside {r.models} model calls at {MODEL_RPM}/min", *_summary(r.beside),
                  h.fmt(r.beside_rate)]]
    told = "; ".join(f"{backend}: {r.model_done} of {r.models} model calls finished ({r.requests} requests reached "
                     f"the fake, the pool paused {r.pauses} time(s))" for backend, r in runs.items())
    report.add("Pools: searches beside a rate-limited model pool", h.table(
        ["search backend", "searches", "n", "p50 wait (ms)", "p95 wait (ms)", "max (ms)", "calls/s"], rows)
        + f"\n\nWhile the searches ran beside it, the model pool ({MODEL_RPM}/min) started its first minute's "
          f"allowance at once, its provider answered one 429 with Retry-After: {PAUSE_S}, and the rest waited for "
          f"the pause and then the rate ({told}). Waits: due to started, from the operations' rows; {SEARCHES} "
          f"searches at once against the tool pool's {settings.LONGHAUL_TOOL_CONCURRENCY} slots, so the later ones "
          f"wait for the earlier to end. The target is the remote API's: a wait there is the gateway's scheduling. "
          f"An offline corpus search is this process's CPU (SQLite full-text search, in threads), so its "
          f"searches' pace is the process's CPU, which the model calls beside them share, and which moves from "
          f"run to run by more than the target's 250 ms.")
    web = runs["web"]
    bound = h.percentile(web.alone, 95) + 250
    report.targets.append(h.Target(
        "searches keep their pace beside a rate-limited, paused model pool (remote search API; p95 wait within "
        "250 ms of alone)",
        f"{h.fmt(h.percentile(web.beside, 95))} ms vs {h.fmt(h.percentile(web.alone, 95))} + 250 ms",
        h.percentile(web.beside, 95) <= bound and web.model_done < web.models and web.pauses >= 1))


def _summary(values: list[float]) -> list[str]:
    return [str(len(values)), h.fmt(h.percentile(values, 50)), h.fmt(h.percentile(values, 95)),
            h.fmt(max(values) if values else float("nan"))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--idle", type=int, default=8, help="light tasks on the idle system")
    parser.add_argument("--trickle", type=int, default=30, help="light tasks submitted singly under the flood")
    parser.add_argument("--burst", type=int, default=20, help="light tasks submitted at once under the flood")
    parser.add_argument("--timeout", type=float, default=300, help="seconds allowed for one phase")
    parser.add_argument("--part", choices=("all", "admission", "pools"), default="all",
                        help="admission phases, the pools, or both")
    args = parser.parse_args()
    for name, limit in LIMITS.items():
        if not 0 < getattr(args, name) <= limit:
            parser.error(f"--{name} must be above 0 and at most {limit}")
    report = run(idle=args.idle, trickle_count=args.trickle, burst_count=args.burst, timeout=args.timeout,
                 part=args.part)
    print()
    print(report.markdown())


if __name__ == "__main__":
    main()
