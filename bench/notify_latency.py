"""Notification latency: from a task's terminal commit to the assistant's message about it in the
task's thread, through the outbox (real qcluster), beside a 1-second polling loop.

    DATABASE_URL=postgres://longhaul:longhaul@127.0.0.1:5432/longhaul_bench \\
        .venv/bin/python bench/notify_latency.py --tasks 30 --every 0.5

N one-step `sleep` tasks, each in a thread of its own (so no notification waits for a busy
thread), are submitted one every `--every` seconds to a qcluster of W workers. For each task:

    outbox  = Message.created_at (the notification run's assistant message) - Task.finished_at

Both are the clock the runtime reads just before the commit that stores them. The baseline is
the design this outbox replaces: a loop that looks for finished tasks once a second and then
starts the notification. A real such loop runs in this script during the measurement (its own
connection, one query a second); for each task it notes when the loop first saw it finished,
and the baseline latency is

    poll = (seen by the 1 s loop - Task.finished_at) + (Message.created_at - Run.created_at)

that is, the polling delay plus the same notification run the outbox path started (the loop
does not start runs itself, so both figures share one run time). It leaves out what the
outbox's delivery job does before the run starts (claim, snapshot), which favours the baseline.
Every row made is deleted at the end.
"""

from __future__ import annotations

import argparse
import threading
import time

import _harness as h
from django.db import connection

from chat.models import Message, Run, Thread
from tasks import actions
from tasks.models import Task

TARGET_P50_MS = 1000.0
POLL_SECONDS = 1.0
LIMITS = {"tasks": 500, "every": 10.0, "workers": 8, "timeout": 600}


class Poller(threading.Thread):
    """The baseline's 1-second loop: which of the tenant's tasks are finished, first seen when."""

    def __init__(self, tenant_id: int, interval: float) -> None:
        super().__init__(name="bench-poller", daemon=True)
        self.tenant_id, self.interval = tenant_id, interval
        self.seen: dict[int, float] = {}
        self.stopping = threading.Event()

    def run(self) -> None:
        try:
            while not self.stopping.is_set():
                ids = Task.objects.filter(tenant_id=self.tenant_id, finished_at__isnull=False).values_list(
                    "pk", flat=True)
                now = time.time()
                for task_id in ids:
                    self.seen.setdefault(task_id, now)
                self.stopping.wait(self.interval)
        finally:
            connection.close()


def delivered(ids: list[int]) -> bool:
    return Message.objects.filter(run__task_id__in=ids, run__kind=Run.Kind.NOTIFICATION,
                                  role=Message.Role.ASSISTANT).count() >= len(ids)


def run(*, tasks: int = 30, every: float = 0.5, workers: int = 2, timeout: float = 120) -> h.Report:
    h.migrate_if_needed()
    report = h.Report(
        "notify_latency", "Notification latency: terminal commit to the message in the thread",
        f"{tasks} one-step sleep tasks, each in its own thread, submitted one every {every:g} s to a qcluster of "
        f"{workers} workers; Task.finished_at to the notification run's assistant Message.created_at, beside a "
        f"real 1 s polling loop (its first sighting of each finished task plus the same run time).",
    )
    scope = h.Scope.create("notify")
    ids: list[int] = []
    try:
        threads = [Thread.objects.create(tenant=scope.tenant, owner=scope.user, title=f"notify {n}")
                   for n in range(tasks)]
        with h.qcluster("notify_latency", workers=workers):
            warm = Thread.objects.create(tenant=scope.tenant, owner=scope.user, title="warm-up")
            warm_task = actions.submit(tenant=scope.tenant, user=scope.user, submission=actions.Submission(
                kind="sleep", input={"steps": 1, "step_seconds": 0}, name="warm-up", thread_id=warm.pk))[0]
            h.wait_until(lambda: delivered([warm_task.pk]), timeout=60, interval=0.1, message="the warm-up note")
            poller = Poller(scope.tenant.pk, POLL_SECONDS)
            poller.start()
            try:
                for n, thread in enumerate(threads):
                    task, _ = actions.submit(tenant=scope.tenant, user=scope.user, submission=actions.Submission(
                        kind="sleep", input={"steps": 1, "step_seconds": 0.1}, name=f"notify {n}",
                        thread_id=thread.pk))
                    ids.append(task.pk)
                    time.sleep(every)
                h.wait_until(lambda: delivered(ids), timeout=timeout, interval=0.2,
                             message=f"{tasks} notifications")
                time.sleep(POLL_SECONDS * 1.5)  # the poller's next round sees the last task too
            finally:
                poller.stopping.set()
                poller.join(timeout=10)

        outbox, poll, dispatch, run_time = [], [], [], []
        for task in Task.objects.filter(pk__in=ids):
            notify_run = Run.objects.filter(task_id=task.pk, kind=Run.Kind.NOTIFICATION).order_by("pk").first()
            reply = Message.objects.get(run=notify_run, role=Message.Role.ASSISTANT)
            finished = task.finished_at.timestamp()
            outbox.append((reply.created_at.timestamp() - finished) * 1000)
            dispatch.append((notify_run.created_at.timestamp() - finished) * 1000)
            run_time.append((reply.created_at - notify_run.created_at).total_seconds() * 1000)
            if task.pk in poller.seen:
                poll.append((poller.seen[task.pk] - finished) * 1000 + run_time[-1])
        missed = len(ids) - len(poll)
    finally:
        scope.purge()

    def row(name: str, values: list[float]) -> list[str]:
        return [name, h.fmt(h.percentile(values, 50), 0), h.fmt(h.percentile(values, 90), 0),
                h.fmt(h.percentile(values, 99), 0), str(len(values))]

    report.add("Latency (milliseconds)", h.table(["path", "p50", "p90", "p99", "tasks"], [
        row("outbox: finished_at -> assistant message", outbox),
        row("↳ finished_at -> notification run created", dispatch),
        row("↳ run created -> assistant message", run_time),
        row("baseline: 1 s polling loop + the same run", poll),
    ]))
    if missed:
        report.notes.append(f"the polling loop had not seen {missed} finished task(s) when it stopped.")
    report.notes.append("The notifier tells a `sleep` task's end without a model call, so no model time is "
                        "included; with a model, add its latency to both rows.")
    p50 = h.percentile(outbox, 50)
    report.targets.append(h.Target("notification within 1 s p50 of the terminal commit (plus model time)",
                                   f"{p50:.0f} ms p50 (polling baseline {h.percentile(poll, 50):.0f} ms)",
                                   p50 < TARGET_P50_MS))
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=30)
    parser.add_argument("--every", type=float, default=0.5, help="seconds between submissions")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=120, help="seconds allowed for the last notification")
    args = parser.parse_args()
    for name, limit in LIMITS.items():
        if not 0 < getattr(args, name) <= limit:
            parser.error(f"--{name} must be above 0 and at most {limit}")
    report = run(tasks=args.tasks, every=args.every, workers=args.workers, timeout=args.timeout)
    print()
    print(report.markdown())


if __name__ == "__main__":
    main()
