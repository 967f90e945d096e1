"""Research tasks in flight at a steady level: bench/inflight.py's gateway figures while N tasks are always running.

    DATABASE_URL=postgres://longhaul:longhaul@127.0.0.1:5432/longhaul_bench \\
        .venv/bin/python bench/inflight_steady.py --levels 50,100,200 --rounds 2

bench/inflight.py starts its 200 tasks in the same instant, so their calls and steps come in waves of 200 and
its figures are how long a wave takes to drain. Here the same tasks (the same loopback model fake, search site and
pages, pools and cluster) are submitted as a service meets them: ramped up over RAMP_SECONDS to N in flight, then
one submitted as one ends, until `--total` have been (3 N by default). The figures are those of the calls
requested, and the steps that asked for them, while N were in flight (from the moment N were first running to the
last submission), beside the same figures at lower levels and how busy the machine's cores were.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from collections import Counter
from dataclasses import dataclass
from statistics import median

import _harness as h
from _web_site import WebSite
from inflight import (
    CLAIM_WAIT_TARGET_MS,
    FROM_ANSWER,
    NEXT_STEP_TARGET_MS,
    POOL_CONCURRENCY,
    ROLES,
    Sampler,
    TrackingFake,
    cluster_env,
    gateway_cap,
    pipeline_waits,
    submit_research,
)

from tasks.models import Task
from tasks.statuses import TERMINAL, TaskStatus

RAMP_SECONDS = 10.0  # about a task's life at 2 s model calls: the first N start spread over it, not at once
LOOK_EVERY = 0.05  # how often the submitter counts what is in flight
BUSY_AT_MOST = 0.8  # a machine's cores busy at most, for steps not to queue for them (the capacity note)
LIMITS = {"level": 1000, "total": 5000, "rounds": 9, "delay": 30.0, "workers": 8}
INTERVALS = ("model call: requested -> claimed by a gateway job", "tool call: requested -> claimed by a gateway job",
             f"{FROM_ANSWER} -> next step committed")


@dataclass
class Round:
    level: int
    waits: dict[str, list[float]]
    statuses: Counter[str]
    steady_seconds: float  # N in flight, from the first moment to the last submission
    finished_per_minute: float  # tasks that ended in that window, a minute's worth
    cores_busy: float  # share of the machine's cores busy from the first call out to the end
    cpu: dict[str, float]  # CPU seconds by part (inflight.ROLES)
    steady_cpu_per_task: float  # the machine's busy CPU seconds while N were in flight, a task finished meanwhile

    def p50(self, interval: str) -> float:
        return h.percentile(self.waits[interval], 50)

    def share(self, role: str) -> float:
        """The part `role` took of the CPU the round's processes used."""
        return self.cpu[role] / (sum(self.cpu.values()) or 1.0)


def in_flight(tenant_id: int) -> int:
    return Task.objects.filter(tenant_id=tenant_id).exclude(status__in=TERMINAL).count()


def one_round(fake: TrackingFake, env: dict[str, str], *, level: int, total: int, workers: int,
              timeout: float) -> Round:
    """`total` research tasks under a tenant of their own, kept `level` in flight, through a cluster started for them."""
    scope = h.Scope.create("inflight_steady", max_running=level + 10)
    try:
        fake.reset()
        h.vacuum_analyze()
        sampler = Sampler(fake, list)
        ids: list[int] = []
        with h.qcluster("inflight_steady", workers=workers, **env) as cluster:
            sampler.find_pids = cluster.descendants
            sampler.start()
            try:
                h.wait_until(lambda: len(cluster.descendants()) >= workers, timeout=60, message="the workers to start")
                started, reached = time.monotonic(), None
                while len(ids) < total:
                    running = in_flight(scope.tenant.pk)
                    if reached is None and running >= level:
                        reached = time.time()
                    allowed = min(level, math.ceil((time.monotonic() - started) / RAMP_SECONDS * level))
                    for _ in range(min(allowed - running, total - len(ids))):
                        # One task a transaction, as the API submits them: a batch in one transaction would hold
                        # the admission lock (scheduling.admit) from its first task to its commit, and the workers
                        # ending tasks, which admit too, would wait that long.
                        more, _ = submit_research(scope, 1)
                        ids += more
                    time.sleep(LOOK_EVERY)
                last_submitted = time.time()
                h.wait_until(lambda: in_flight(scope.tenant.pk) == 0, timeout=timeout, interval=0.5,
                             message=f"{total} research tasks to end")
            finally:
                sampler.stopping.set()
                sampler.join(timeout=10)
        if reached is None:
            raise RuntimeError(f"never {level} tasks in flight at once: raise --total")
        window = (reached, last_submitted)
        waits = pipeline_waits(ids, cap=gateway_cap(1), window=window)
        ended = Task.objects.filter(pk__in=ids, finished_at__isnull=False).values_list("finished_at", flat=True)
        finished = sum(1 for at in ended if window[0] <= at.timestamp() <= window[1])
        statuses = Counter(Task.objects.filter(pk__in=ids).values_list("status", flat=True))
    finally:
        scope.purge()
    cores = sampler.busy
    busy = (cores[-1][1] - cores[0][1]) / (cores[-1][2] - cores[0][2]) if len(cores) > 1 else 0.0
    steady = window[1] - window[0]
    return Round(level=level, waits=waits, statuses=statuses, steady_seconds=steady,
                 finished_per_minute=finished / steady * 60 if steady else 0.0, cores_busy=busy,
                 cpu=sampler.cpu.by_role(gateway=set(sampler.max_per_pid)),
                 steady_cpu_per_task=busy_seconds(cores, *window) / finished if finished else 0.0)


def busy_seconds(busy: list[tuple[float, float, float]], start: float, end: float) -> float:
    """The machine's busy CPU seconds, all cores, between its first and last sample (Sampler.busy, every 0.2 s) from
    `start` to `end`."""
    inside = [seconds for at, seconds, _ in busy if start <= at <= end]
    return inside[-1] - inside[0] if len(inside) > 1 else 0.0


def run(*, levels: tuple[int, ...] = (50, 100, 200), total: int | None = None, rounds: int = 2, delay: float = 2.0,
        workers: int = 2, timeout: float = 300) -> h.Report:
    h.migrate_if_needed()
    levels = tuple(sorted(set(levels)))
    top = levels[-1]
    report = h.Report(
        "inflight_steady", "Research tasks in flight at a steady level",
        f"bench/inflight.py's research tasks, model fake ({delay:g} s an answer), search site and pages, pools "
        f"({POOL_CONCURRENCY} each) and cluster ({workers} worker processes, one gateway turn), but submitted as a "
        f"service meets them: ramped up over {RAMP_SECONDS:g} s to N in flight, then one submitted as one ends, "
        f"until {f'{total} have' if total else '3 N have'} been. The figures are of the calls requested (and the steps that asked for them) while N "
        f"were in flight; N = {', '.join(map(str, levels))}, {rounds} round(s) each, each round with tasks and a "
        f"cluster of its own. The targets are bench/inflight.py's, judged at N = {top} on the median of the rounds.")
    with TrackingFake(delay) as fake, WebSite() as site:
        env = cluster_env(fake, site.url, max_running=top + 10)
        with h.override(LONGHAUL_MAX_RUNNING=top + 10, **{k: v for k, v in env.items() if k.startswith("LONGHAUL_MODEL")}):
            done = [one_round(fake, env, level=level, total=total or 3 * level, workers=workers, timeout=timeout)
                    for level in levels for _ in range(rounds)]
    report.add("Rounds", h.table(
        ["in flight", "model call requested -> claimed, p50 ms", "tool call requested -> claimed, p50 ms",
         "last answer -> next step committed, p50 / p90 ms", "tasks finished per minute", "cores busy",
         "CPU s: gateway's worker / other workers / PostgreSQL / this process (submissions, fakes)", "steady for"],
        [[r.level, h.fmt(r.p50(INTERVALS[0]), 0), h.fmt(r.p50(INTERVALS[1]), 0),
          f"{h.fmt(r.p50(INTERVALS[2]), 0)} / {h.fmt(h.percentile(r.waits[INTERVALS[2]], 90), 0)}",
          f"{r.finished_per_minute:.0f}", f"{r.cores_busy:.0%}",
          " / ".join(f"{r.cpu[role]:.1f}" for role in (ROLES[0], ROLES[1], ROLES[3], ROLES[4])),
          f"{r.steady_seconds:.0f} s"] for r in done]))
    by_level = {level: [r for r in done if r.level == level] for level in levels}
    judged = by_level[top]
    claims = {kind: median(r.p50(f"{kind} call: requested -> claimed by a gateway job") for r in judged)
              for kind in ("model", "tool")}
    next_step = median(r.p50(INTERVALS[2]) for r in judged)
    outcomes = sum((r.statuses for r in done), Counter())
    report.targets.append(h.Target("every task succeeded", ", ".join(f"{k} {v}" for k, v in outcomes.items()),
                                   outcomes.get(TaskStatus.SUCCEEDED, 0) == sum(outcomes.values())))
    report.targets.append(h.Target(
        f"{top} in flight: a call requested -> claimed by a gateway job, p50 < {CLAIM_WAIT_TARGET_MS} ms",
        f"model {claims['model']:,.0f} ms, tool {claims['tool']:,.0f} ms", max(claims.values()) < CLAIM_WAIT_TARGET_MS))
    report.targets.append(h.Target(
        f"{top} in flight: a step's last answer (the gateway had it) -> its next step committed, "
        f"p50 < {NEXT_STEP_TARGET_MS} ms", f"{next_step:,.0f} ms", next_step < NEXT_STEP_TARGET_MS))
    if len(levels) > 1:
        below = levels[-2]
        pace = {level: median(r.finished_per_minute for r in rounds_at) for level, rounds_at in by_level.items()}
        cores = {level: median(r.cores_busy for r in rounds_at) for level, rounds_at in by_level.items()}
        report.notes.append(
            f"From {below} to {top} in flight the tasks finished per minute went {pace[below]:.0f} -> {pace[top]:.0f} "
            f"({pace[top] / pace[below]:.2f}x) for {top / below:.2f}x the tasks, with the cores "
            f"{cores[below]:.0%} -> {cores[top]:.0%} busy (medians of the rounds): where the pace stops growing with "
            "the tasks, the machine has no more to give them, and each step waits for the ones before it.")
        report.notes.append(capacity_note(by_level, lowest=levels[0], top=top))
    report.notes.append(
        "Cores busy is /proc/stat's, every 0.2 s from the first model call out to the end; the CPU seconds are "
        "each process's, over the same time (bench/inflight.py's parts). This benchmark's process submits the tasks, "
        "as the web service would, and runs the fakes, which stand for other machines: both share this machine's "
        "2 cores with the cluster and PostgreSQL.")
    return report


def capacity_note(by_level: dict[int, list[Round]], *, lowest: int, top: int) -> str:
    """What `top` in flight ask of this machine's cores, from a task's life at the `lowest` level (Little's law: in
    flight = tasks finished a second x a task's life) and the CPU a task took while `top` were in flight (the whole
    machine's: every part, this process's fakes too)."""
    pace = median(r.finished_per_minute for r in by_level[lowest]) / 60
    life = lowest / pace
    asked = top / life
    per_task = median(r.steady_cpu_per_task for r in by_level[top])
    fakes = per_task * median(r.share(ROLES[4]) for r in by_level[top])
    cores = len(os.sched_getaffinity(0))
    within = BUSY_AT_MOST * cores / asked
    said = (f"What {top} in flight ask of this machine: a task lived {life:.1f} s at {lowest} in flight (in flight / "
            f"tasks finished a second), which includes some waiting already; at that life {top} in flight finish "
            f"{asked:.1f} tasks a second. While {top} were in flight the machine's cores (every process on it) spent "
            f"{per_task * 1000:.0f} ms of CPU a task finished (about {fakes * 1000:.0f} ms of it this process's "
            f"submissions and fakes, by its share of the round's CPU): {asked * per_task:.1f} cores of the machine's "
            f"{cores}.")
    if per_task <= within:
        return f"{said} That is within {BUSY_AT_MOST:.0%} of them: the steps need not queue for a core."
    return (f"{said} Past {BUSY_AT_MOST:.0%} of them, each step queues for a core, and past all of them tasks finish "
            f"no faster: the last answer -> next step wait above. To keep the cores at most {BUSY_AT_MOST:.0%} busy "
            f"at that pace, a task may take {within * 1000:.0f} ms of CPU, {1 - within / per_task:.0%} less; the "
            f"fakes' share left as it is, Longhaul's part would have to fall from {(per_task - fakes) * 1000:.0f} to "
            f"{max(within - fakes, 0) * 1000:.0f} ms.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--levels", default="50,100,200", help="tasks kept in flight, comma-separated")
    parser.add_argument("--total", type=int, help="tasks submitted in a round (default: 3 times the level)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds at each level")
    parser.add_argument("--delay", type=float, default=2.0, help="seconds the fake takes to answer")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=300, help="seconds allowed for a round's tasks to end")
    args = parser.parse_args()
    try:
        levels = tuple(int(level) for level in args.levels.split(","))
    except ValueError:
        parser.error(f"--levels: not a comma-separated list of whole numbers: {args.levels!r}")
    for name, value in (("level", max(levels)), ("total", args.total or 0), ("rounds", args.rounds),
                        ("delay", args.delay), ("workers", args.workers)):
        if value > LIMITS[name]:
            parser.error(f"--{name} {value} is above this benchmark's limit of {LIMITS[name]}")
    if min(levels) < 1 or args.rounds < 1 or args.workers < 1 or args.delay < 0:
        parser.error("--levels, --rounds and --workers must be at least 1, --delay at least 0")
    if args.total is not None and args.total < max(levels):
        parser.error(f"--total {args.total} is below the highest level, {max(levels)}: it would never be reached")
    report = run(levels=levels, total=args.total, rounds=args.rounds, delay=args.delay, workers=args.workers,
                 timeout=args.timeout)
    print(report.markdown())


if __name__ == "__main__":
    main()
