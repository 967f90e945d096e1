"""Idle cost: what a worker machine burns while nothing is due, beside django-q2's own cluster.

    DATABASE_URL=postgres://longhaul:longhaul@127.0.0.1:5432/longhaul_bench \\
        .venv/bin/python bench/idle.py --seconds 20 --workers 2

Longhaul's worker service as the Procfile runs it (`manage.py worker`: the task cluster with W workers,
and `manage.py worker --queue chat` beside it), then django-q2's own `manage.py qcluster` with its stock
ORM broker (bench/_stock_broker.py) and W workers, at the same poll interval (LONGHAUL_Q_POLL). Each
runs alone against an empty broker table: after a warm-up, for `--seconds`, the CPU time of every
process of its service (/proc/<pid>/stat, utime + stime; psutil is not installed), the CPU time of
every PostgreSQL process (new backends counted from zero), and the transactions committed in the
database (pg_stat_database). The machine is shared: the database's figure includes whatever else ran.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import _harness as h
from _processes import processes
from django.conf import settings
from django.db import connection

WARM_UP_SECONDS = 10.0  # the clusters start their processes (their schedule, a sweep a minute, may fall in either window)
LIMITS = {"seconds": 300.0, "workers": 8}


def cpu_seconds(pids: list[int]) -> dict[int, float]:
    """pid -> CPU seconds used so far (utime + stime), for those still alive."""
    wanted = set(pids)
    return {proc.pid: proc.cpu for proc in processes() if proc.pid in wanted}


def postgres_pids() -> list[int]:
    return [proc.pid for proc in processes() if proc.name == "postgres"]


def chat_service() -> list[int]:
    """Pids of the chat queue's `manage.py worker --queue chat` and its processes."""
    return [proc.pid for proc in processes() if proc.is_chat_service]


def commits() -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_stat_clear_snapshot()")  # a fresh read, not this transaction's snapshot
        cursor.execute("SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()")
        return int(cursor.fetchone()[0])


def measure(pids: Callable[[], list[int]], seconds: float) -> dict[str, float]:
    """CPU % of one core (the service's processes, PostgreSQL's) and commits/s over `seconds`."""
    ours, pg = pids(), postgres_pids()
    before_ours, before_pg, before_commits = cpu_seconds(ours), cpu_seconds(pg), commits()
    started = time.monotonic()
    time.sleep(seconds)
    elapsed = time.monotonic() - started
    after_ours, after_pg = cpu_seconds(pids()), cpu_seconds(postgres_pids())
    after_commits = commits()

    def spent(before: dict[int, float], after: dict[int, float]) -> float:
        return sum(used - before.get(pid, 0.0) for pid, used in after.items())

    return {"service": spent(before_ours, after_ours) / elapsed * 100,
            "postgres": spent(before_pg, after_pg) / elapsed * 100,
            "commits": (after_commits - before_commits - 2) / elapsed}  # less this function's own two reads


def run(*, seconds: float = 20.0, workers: int = 2) -> h.Report:
    h.migrate_if_needed()
    poll = settings.Q_CLUSTER["poll"]
    report = h.Report(
        "idle", "Idle cost: a worker machine with nothing due",
        f"Longhaul's worker service (`manage.py worker`, {workers} workers, and the chat queue's "
        f"`manage.py worker --queue chat`), then django-q2's own `manage.py qcluster` with its stock ORM broker "
        f"({workers} workers), each alone with an empty broker table at a poll interval of {poll:g} s; after "
        f"{WARM_UP_SECONDS:g} s of warm-up, {seconds:g} s of CPU time (percent of one core) and commits.",
    )
    figures: dict[str, dict[str, float]] = {}
    with h.qcluster("idle", workers=workers) as cluster:
        time.sleep(WARM_UP_SECONDS)
        # The chat cluster is its own process group, started beside this one: found by its command line.
        figures["longhaul"] = measure(lambda: [cluster.pid, *cluster.descendants(), *chat_service()], seconds)
    with h.qcluster("idle-stock", workers=workers, command=("qcluster",), chat=False,
                    DJANGO_SETTINGS_MODULE="bench._stock_broker") as stock:
        time.sleep(WARM_UP_SECONDS)
        figures["stock"] = measure(lambda: [stock.pid, *stock.descendants()], seconds)

    ours, stock_ = figures["longhaul"], figures["stock"]
    report.add("While nothing is due", h.table(
        ["service", "its processes, % of a core", "PostgreSQL, % of a core", "commits/s"],
        [["Longhaul: task cluster and chat cluster", h.fmt(ours["service"]), h.fmt(ours["postgres"]),
          h.fmt(ours["commits"])],
         ["django-q2 qcluster, stock ORM broker (baseline)", h.fmt(stock_["service"]), h.fmt(stock_["postgres"]),
          h.fmt(stock_["commits"])]]))
    report.notes.append(
        "Longhaul's pusher waits for a kick (LISTEN) until the first broker row comes due, a second at most; "
        "django-q2's ORM broker looks at its table every poll interval. Longhaul runs two clusters here, "
        "the baseline one.")
    total_ours, total_stock = ours["service"] + ours["postgres"], stock_["service"] + stock_["postgres"]
    report.targets.append(h.Target(
        "an idle worker machine costs less CPU than django-q2's own idle cluster (processes and database)",
        f"{total_ours:.1f}% vs {total_stock:.1f}% of a core", total_ours < total_stock))
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=20.0, help="length of each measurement")
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    for name, limit in LIMITS.items():
        if not 0 < getattr(args, name) <= limit:
            parser.error(f"--{name} must be above 0 and at most {limit:g}")
    report = run(seconds=args.seconds, workers=args.workers)
    print()
    print(report.markdown())


if __name__ == "__main__":
    main()
