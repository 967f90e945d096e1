"""Checkpointed-step throughput: N `sleep` tasks of S zero-length steps through W qcluster workers,
next to raw django-q2, the database's own ceiling and DBOS Transact, measured in the same run.

    DATABASE_URL=postgres://longhaul:longhaul@127.0.0.1:5432/longhaul_bench \\
        .venv/bin/python bench/throughput.py --tasks 200 --steps 5 --workers 2 --rounds 3

Per round, with one real qcluster (W workers) already warm:
- raw django-q2: N*S no-op `async_task`s (save=False) enqueued in one transaction; from its
  commit to the broker table drained (django-q2 deletes a message when it acknowledges it);
- Longhaul: N sleep tasks of S steps submitted through tasks.actions.submit in one transaction;
  from its commit to the last task's finished_at, and the write-ahead log the server wrote meanwhile
  (measured the same way around DBOS's rounds: what each writes a step, steadier than time here);
- the database ceiling: W connections, each looping a SKIP LOCKED claim (one transaction) and a
  fenced completion (another) as plain SQL over a scratch table of N*S rows.
Each Longhaul round and each DBOS round starts with VACUUM (ANALYZE) of the tables it writes, as
autovacuum would have run between two bursts (this machine's PostgreSQL has it off).
Then, on the idle cluster, tasks of 5 steps one at a time: end to end time, and the gap between
consecutive checkpoints of a task (the runtime's own cost per step: the steps do nothing).
Then, with the cluster stopped, `tasks.jobs.advance` in this process: one step per call (wall time
and SQL statements of a step after a kick, without the broker), a task whose steps run in place
(statements of each such step) and tasks due together that one worker's turn goes through (statements
a step); and the time a commit spends handing a wake-up to the process's
sender, with the wake-ups the workers logged as failed during the run.
Finally DBOS Transact itself (bench/dbos_peer.py, the `bench` extra): the same workload of S-step
workflows through a DBOS queue with the same number of processes, its system database on the same
PostgreSQL, and one 5-step workflow at a time through its queue and started directly.
Rows, broker messages, the scratch table and DBOS's database are removed at the end.
"""

from __future__ import annotations

import argparse
import os
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import _harness as h
import dbos_peer
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext
from django_q.models import OrmQ
from django_q.signing import SignedPackage
from django_q.tasks import async_task

from tasks import actions, clock, events, jobs, leases
from tasks.models import AdmissionRecord, Checkpoint, Operation, Task, TaskEvent
from tasks.statuses import TERMINAL, TaskStatus

RATIO_TARGET = 0.70
OVERHEAD_TARGET_MS = 5.0
STATEMENTS_TARGET = 6
WAKEUP_HANDOFF_TARGET_US = 100.0
LIMITS = {"tasks": 5000, "steps": 1000, "workers": 16, "rounds": 10, "solo": 500, "timeout": 900}
NOOP = "bench._qnoop.noop"
TASKS_GOING_ON = 10
CHURNED = (Task, TaskEvent, Checkpoint, AdmissionRecord, Operation, OrmQ)  # what a round writes, vacuumed before it


@dataclass
class Round:
    raw_rate: float = 0.0
    longhaul_rate: float = 0.0
    ceiling_rate: float = 0.0
    loaded_gaps_ms: list[float] = field(default_factory=list)
    failed: int = 0
    wal_bytes_per_step: float = 0.0  # the server's WAL written from before the submission to the last task's end


# --- raw django-q2 ---------------------------------------------------------------------


def raw_django_q(count: int, *, timeout: float) -> float:
    """No-op messages per second, from the enqueue commit until django-q2 has acknowledged (deleted) them all."""
    before = OrmQ.objects.order_by("-pk").values_list("pk", flat=True).first() or 0
    with transaction.atomic():
        for n in range(count):
            async_task(NOOP, n, save=False)
    started = time.time()
    # Ours are the new rows; a cheap range probe while they drain (a long IN list polled 50 times a
    # second would cost the database more than the workers' own queries), then a check by payload.
    last = OrmQ.objects.order_by("-pk").values_list("pk", flat=True).first() or before
    h.wait_until(lambda: not OrmQ.objects.filter(pk__gt=before, pk__lte=last).exists(), timeout=timeout,
                 interval=0.02, message=f"{count} no-op messages to drain")
    done = time.time()
    stray = [pk for pk, payload in OrmQ.objects.filter(pk__gt=before).values_list("pk", "payload")
             if _func(payload) == NOOP]
    assert not stray, f"{len(stray)} no-op messages are still queued"
    return count / (done - started)


def _func(payload: str) -> str | None:
    try:
        return SignedPackage.loads(payload).get("func")
    except Exception:
        return None


# --- Longhaul --------------------------------------------------------------------------


def submit_many(scope: h.Scope, count: int, steps: int) -> tuple[list[int], float]:
    """Submit `count` sleep tasks in one transaction; (their ids, the commit time)."""
    with transaction.atomic():
        ids = [
            actions.submit(tenant=scope.tenant, user=scope.user, submission=actions.Submission(
                kind="sleep", input={"steps": steps, "step_seconds": 0}, name=f"bench {n}"))[0].pk
            for n in range(count)
        ]
    return ids, time.time()


def wait_terminal(ids: list[int], *, timeout: float) -> None:
    """Until every task of the benchmark's tenant has ended (earlier ones already have)."""
    tenant_id = Task.objects.filter(pk=ids[0]).values_list("tenant_id", flat=True).get()
    h.wait_until(lambda: not Task.objects.filter(tenant_id=tenant_id).exclude(status__in=TERMINAL).exists(),
                 timeout=timeout, interval=0.02, message=f"{len(ids)} tasks to end")


def checkpoint_gaps(ids: list[int]) -> list[float]:
    """Milliseconds between consecutive checkpoints of each task."""
    gaps: list[float] = []
    last: dict[int, float] = {}
    for task_id, at in Checkpoint.objects.filter(task_id__in=ids).order_by("task_id", "step").values_list(
            "task_id", "at"):
        if task_id in last:
            gaps.append((at.timestamp() - last[task_id]) * 1000)
        last[task_id] = at.timestamp()
    return gaps


def longhaul(scope: h.Scope, tasks: int, steps: int, *, timeout: float) -> Round:
    h.vacuum_analyze(*CHURNED)
    wal_before = h.wal_position()
    ids, started = submit_many(scope, tasks, steps)
    wait_terminal(ids, timeout=timeout)
    wal = (h.wal_position() - wal_before) / (tasks * steps)
    rows = Task.objects.filter(pk__in=ids)
    ended = max(t.timestamp() for t in rows.values_list("finished_at", flat=True))
    failed = rows.exclude(status=TaskStatus.SUCCEEDED).count()
    return Round(longhaul_rate=tasks * steps / (ended - started), loaded_gaps_ms=checkpoint_gaps(ids), failed=failed,
                 wal_bytes_per_step=wal)


def solo(scope: h.Scope, count: int, *, timeout: float) -> tuple[list[float], list[float]]:
    """5-step tasks one at a time on an idle cluster: end to end ms, and checkpoint gaps in ms."""
    e2e, ids = [], []
    for n in range(count):
        (task_id,), started = submit_many(scope, 1, 5)
        wait_terminal([task_id], timeout=timeout)
        finished = Task.objects.get(pk=task_id).finished_at
        e2e.append((finished.timestamp() - started) * 1000)
        ids.append(task_id)
    return e2e, checkpoint_gaps(ids)


# --- the database ceiling --------------------------------------------------------------


def ceiling(rows: int, connections: int) -> float:
    """Claims plus fenced completions per second, plain SQL, `connections` clients, one scratch table."""
    import psycopg

    s = connection.settings_dict
    dsn = dict(host=s["HOST"] or "127.0.0.1", port=s["PORT"] or 5432, dbname=s["NAME"], user=s["USER"],
               password=s["PASSWORD"])
    table = f"bench_ceiling_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(**dsn, autocommit=True) as admin:
        admin.execute(f"CREATE TABLE {table} (id bigserial PRIMARY KEY, status text NOT NULL, token bigint NOT NULL "
                      f"DEFAULT 0, owner text NOT NULL DEFAULT '', due timestamptz NOT NULL DEFAULT now())")
        admin.execute(f"CREATE INDEX {table}_due ON {table} (id) WHERE status = 'queued'")
        admin.execute(f"INSERT INTO {table} (status) SELECT 'queued' FROM generate_series(1, %s)", [rows])
        admin.execute(f"ANALYZE {table}")
        try:
            barrier = threading.Barrier(connections + 1)
            done_at: list[float] = []
            counts: list[int] = []

            def client(n: int) -> None:
                me = f"bench:{n}"
                with psycopg.connect(**dsn, autocommit=True) as conn:
                    claimed = 0
                    barrier.wait()
                    while True:
                        with conn.transaction():
                            row = conn.execute(
                                f"UPDATE {table} SET status = 'running', token = token + 1, owner = %s "
                                f"WHERE id = (SELECT id FROM {table} WHERE status = 'queued' AND due <= now() "
                                f"ORDER BY id LIMIT 1 FOR UPDATE SKIP LOCKED) RETURNING id, token", [me]).fetchone()
                        if row is None:
                            break
                        conn.execute(f"UPDATE {table} SET status = 'done', owner = '' "
                                     f"WHERE id = %s AND token = %s AND owner = %s", [row[0], row[1], me])
                        claimed += 1
                    done_at.append(time.time())
                    counts.append(claimed)

            threads = [threading.Thread(target=client, args=(n,), daemon=True) for n in range(connections)]
            for thread in threads:
                thread.start()
            barrier.wait(timeout=30)
            started = time.time()
            for thread in threads:
                thread.join(timeout=300)
            assert sum(counts) == rows, f"ceiling: {sum(counts)} of {rows} rows completed"
            return rows / (max(done_at) - started)
        finally:
            admin.execute(f"DROP TABLE IF EXISTS {table}")


# --- in process, no broker -------------------------------------------------------------


def in_process(scope: h.Scope, steps: int) -> tuple[list[float], list[int]]:
    """Wall ms and SQL statements of each `advance` (one step each, slice 0), run in this process."""
    with h.override(LONGHAUL_STEP_SLICE_MS=0):
        (task_id,), _ = submit_many(scope, 1, steps)
        times, statements = [], []
        for _ in range(steps):
            with CaptureQueriesContext(connection) as queries:
                started = time.perf_counter()
                jobs.advance(task_id)
                times.append((time.perf_counter() - started) * 1000)
            statements.append(len(queries.captured_queries))
        status = Task.objects.get(pk=task_id).status
        assert status == TaskStatus.SUCCEEDED, f"in-process task ended {status}"
    h.purge_kicks({task_id}, set(), task_arg_zero=True)
    return times, statements


def asking_for_calls(count: int) -> tuple[list[float], list[int]]:
    """Wall ms and SQL statements of `count` steps that ask for calls, after a kick, in this process: each a
    research task's first step, which asks for its plan (a model call a gateway job runs). The tasks come one at
    a time, in a scope of their own: each keeps its slot while it waits for its plan."""
    scope = h.Scope.create("throughput-asking", max_running=count + 10)
    times, statements, ids = [], [], []
    try:
        with h.override(LONGHAUL_STEP_SLICE_MS=0, LONGHAUL_MAX_RUNNING=count + 10):
            for n in range(count):
                task, _ = actions.submit(tenant=scope.tenant, user=scope.user, submission=actions.Submission(
                    kind="research", input={"question": f"How does step {n} ask for its calls?"}, name=f"asking {n}"))
                ids.append(task.pk)
                with CaptureQueriesContext(connection) as queries:
                    started = time.perf_counter()
                    jobs.advance(task.pk)
                    times.append((time.perf_counter() - started) * 1000)
                statements.append(len(queries.captured_queries))
        waiting = Operation.objects.filter(task_id__in=ids, name="plan", status="pending").count()
        assert waiting == count, f"{waiting} of {count} research tasks asked for their plan"
    finally:
        h.purge_kicks(set(ids), set(), task_arg_zero=True)
        scope.purge()
    return times, statements


def in_place(scope: h.Scope, steps: int) -> list[int] | None:
    """SQL statements of each step that ran in place (the worker kept the lease), BEGIN and COMMIT
    included where there are any, with the probe for waiting work before it; None when work waiting in
    the broker made every step yield."""
    # Kicks our earlier tasks left (a lease watchdog's, say) would make every step yield.
    h.purge_kicks(set(Task.objects.filter(tenant=scope.tenant).values_list("pk", flat=True)), set(),
                  task_arg_zero=True)
    with h.override(LONGHAUL_STEP_SLICE_MS=60_000):
        (task_id,), _ = submit_many(scope, 1, steps)
        h.purge_kicks({task_id}, set(), task_arg_zero=True)  # its own first kick: this process runs it
        with CaptureQueriesContext(connection) as queries:
            jobs.advance(task_id)
        status = Task.objects.get(pk=task_id).status
    h.purge_kicks({task_id}, set(), task_arg_zero=True)
    if status != TaskStatus.SUCCEEDED:
        return None  # it yielded after its first step
    per_commit, count, in_transaction = [], 0, False
    for query in queries.captured_queries:
        sql = query["sql"]
        count += 1
        in_transaction = (in_transaction or sql == "BEGIN") and sql != "COMMIT"
        # A commit: a transaction's, or a step's fenced UPDATE committed alone (transitions.commits_alone).
        if sql == "COMMIT" or (not in_transaction and sql.startswith("WITH moved AS (UPDATE")):
            per_commit.append(count)
            count = 0
    # The first step (its claim, one statement, goes with it) and the last (which ends the task) are not in place.
    return per_commit[1:-1] or None


def waiting_besides(ids: list[int]) -> dict[str, int]:
    """Broker rows (by job) and due tasks other than `ids`: a worker's turn ends for the first (a job waits)
    and goes on to the second (the task due longest first), so either keeps `ids` from ending in one turn."""
    found = Counter(str(func) for _, func, arg in h.broker_rows() if arg not in ids)
    found["tasks due"] = leases.due(clock.now()).exclude(pk__in=ids).count()
    return dict(found)


def going_on(scope: h.Scope, tasks: int, steps: int) -> float:
    """SQL statements a step costs when the worker goes on from task to task within its turn (tasks/runner.py):
    `tasks` tasks of `steps` steps, due together, run by one `advance` with the broker empty; the mean over
    all their steps, the first claim and every task's end included."""
    h.purge_kicks(set(Task.objects.filter(tenant=scope.tenant).values_list("pk", flat=True)), set(),
                  task_arg_zero=True)
    with h.override(LONGHAUL_STEP_SLICE_MS=60_000):
        ids, _ = submit_many(scope, tasks, steps)
        h.purge_kicks(set(ids), set(), task_arg_zero=True)
        others = waiting_besides(ids)  # what would make the turn end early, read before it starts
        with CaptureQueriesContext(connection) as queries:
            jobs.advance(ids[0])
        done = Task.objects.filter(pk__in=ids, status=TaskStatus.SUCCEEDED).count()
    h.purge_kicks(set(ids), set(), task_arg_zero=True)
    assert done == tasks, f"going on: {done} of {tasks} tasks succeeded in one turn; waiting besides them: {others}"
    return len(queries.captured_queries) / (tasks * steps)


def _index_counts(table: str) -> tuple[int, int]:
    """The table's indexes, and how many of them are partial."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*), count(indpred) FROM pg_index WHERE indrelid = %s::regclass", [table])
        return cursor.fetchone()


def wakeup_handoff(count: int) -> list[float]:
    """Microseconds a committing thread spends handing one wake-up to the process's sender
    (tasks/events.py), on the channel layer the settings name (Redis in `make bench`)."""
    events.wake_group("bench-warm-up")  # the sender's thread and loop start with the first wake-up
    times = []
    for n in range(count):
        started = time.perf_counter()
        events.wake_group(f"bench-wakeup-{n % 50}", seq=n)
        times.append((time.perf_counter() - started) * 1_000_000)
    events.wakeup_sender().drain(timeout=30)
    return times


def failed_wakeups(log_dir: Path) -> int:
    """Wake-ups the workers logged as failed (tasks/events.py logs each one)."""
    return sum(path.read_text(errors="replace").count("wake-up for") for path in log_dir.glob("*.log"))


# --- the benchmark ---------------------------------------------------------------------


def run(*, tasks: int = 100, steps: int = 5, workers: int = 2, rounds: int = 4, solo_tasks: int = 20,
        timeout: float = 300) -> h.Report:
    h.migrate_if_needed()
    report = h.Report(
        "throughput", "Checkpointed-step throughput",
        f"{tasks} sleep tasks x {steps} zero-length steps through {workers} qcluster workers on PostgreSQL, "
        f"{rounds} round(s), each beside raw django-q2 ({tasks * steps} no-op messages, same workers) and the "
        f"database ceiling (SKIP LOCKED claim + fenced completion, plain SQL, {workers} connections). "
        f"Rates from the enqueue/submit commit to the last completion.",
    )
    leftover = OrmQ.objects.count()
    if leftover:
        report.notes.append(f"{leftover} broker rows were already queued in this database before the run; "
                            "they may cost the cluster some time.")
    scope = h.Scope.create("throughput", max_running=tasks + 10)
    results: list[Round] = []
    try:
        with h.override(LONGHAUL_MAX_RUNNING=tasks + 10):
            with h.qcluster("throughput", workers=workers, LONGHAUL_MAX_RUNNING=str(tasks + 10)):
                # Warm up: workers spawned, imports done, connections open.
                raw_django_q(20, timeout=120)
                ids, _ = submit_many(scope, 4, 2)
                wait_terminal(ids, timeout=120)
                for _ in range(rounds):
                    r = Round(raw_rate=raw_django_q(tasks * steps, timeout=timeout))
                    lh = longhaul(scope, tasks, steps, timeout=timeout)
                    r.longhaul_rate, r.loaded_gaps_ms, r.failed = lh.longhaul_rate, lh.loaded_gaps_ms, lh.failed
                    r.wal_bytes_per_step = lh.wal_bytes_per_step
                    r.ceiling_rate = ceiling(tasks * steps, workers)
                    results.append(r)
                    print(f"round {len(results)}: raw django-q2 {r.raw_rate:.0f} msg/s, Longhaul "
                          f"{r.longhaul_rate:.0f} steps/s, ceiling {r.ceiling_rate:.0f}/s", flush=True)
                e2e, gaps = solo(scope, solo_tasks, timeout=timeout)
            wakeup_failures = failed_wakeups(h.log_dir("throughput"))
            # The same rounds with content at rest in the clear (tasks/crypto.py off), to say what sealing costs.
            with h.override(LONGHAUL_ENCRYPT_AT_REST=False):
                with h.qcluster("throughput-clear", workers=workers, LONGHAUL_MAX_RUNNING=str(tasks + 10),
                                LONGHAUL_ENCRYPT_AT_REST="0"):
                    ids, _ = submit_many(scope, 4, 2)
                    wait_terminal(ids, timeout=120)
                    clear_rates = [longhaul(scope, tasks, steps, timeout=timeout).longhaul_rate
                                   for _ in range(rounds)]
                clear_times, _ = in_process(scope, 30)  # no cluster left to take its kicks
            times, statements = in_process(scope, 30)
            asking_times, asking_statements = asking_for_calls(30)
            kept_statements = in_place(scope, 10)
            switching_statements = going_on(scope, TASKS_GOING_ON, steps)
            handoff_us = wakeup_handoff(20_000)
        # DBOS on the same PostgreSQL with the same number of processes, Longhaul's cluster stopped.
        missing = dbos_peer.available()
        peer = None if missing else dbos_peer.run(
            database_url=os.environ["DATABASE_URL"], workflows=tasks, steps=steps, processes=workers,
            rounds=rounds, solo=solo_tasks, timeout=timeout)
    finally:
        scope.purge()
        h.purge_kicks(set(), set(), funcs=[NOOP])

    raw = h.median(r.raw_rate for r in results)
    lh = h.median(r.longhaul_rate for r in results)
    ceil = h.median(r.ceiling_rate for r in results)
    failed = sum(r.failed for r in results)
    rows = [[f"round {i + 1}", h.fmt(r.raw_rate, 0), h.fmt(r.longhaul_rate, 0), f"{r.longhaul_rate / r.raw_rate:.0%}",
             h.fmt(r.ceiling_rate, 0)] for i, r in enumerate(results)]
    rows.append(["**median**", h.fmt(raw, 0), h.fmt(lh, 0), f"{lh / raw:.0%}", h.fmt(ceil, 0)])
    report.add("Rates (per second)", h.table(
        ["", "raw django-q2 no-op msg/s", "Longhaul steps/s", "Longhaul / raw", "DB ceiling claim+complete/s"], rows))

    clear = h.median(clear_rates)
    report.add("Encryption at rest (content sealed with the tenant's key, AES-256-GCM)", h.table(
        ["", "sealed (default)", "in the clear", "sealed / clear"],
        [[f"{steps}-step workloads, checkpointed steps/s (median of {rounds})", h.fmt(lh, 0), h.fmt(clear, 0),
          f"{lh / clear:.0%}"],
         ["`advance` in-process, one step per call, p50 ms", h.fmt(h.percentile(times, 50), 2),
          h.fmt(h.percentile(clear_times, 50), 2),
          f"{h.percentile(times, 50) / h.percentile(clear_times, 50):.0%}"]])
        + f"\n\nRounds in the clear: {', '.join(h.fmt(r, 0) for r in clear_rates)} steps/s, by a second cluster "
          "started with LONGHAUL_ENCRYPT_AT_REST=0 after the sealed rounds.")

    e2e_p50 = h.percentile(e2e, 50)
    if peer is None:
        report.notes.append(f"DBOS was not measured: {missing}.")
    else:
        dbos_rate = h.median(peer.steps_per_second)
        dbos_wal, lh_wal = h.median(peer.wal_bytes_per_step), h.median(r.wal_bytes_per_step for r in results)
        queued_p50 = h.percentile(peer.queued_e2e_ms, 50)
        report.add("Beside DBOS Transact (same PostgreSQL, same number of processes)", h.table(
            ["", "DBOS", "Longhaul", "Longhaul / DBOS"],
            [
                [f"{steps}-step workloads, checkpointed steps/s (median of {rounds})", h.fmt(dbos_rate, 0),
                 h.fmt(lh, 0), f"{lh / dbos_rate:.0%}"],
                ["one 5-step task alone, p50 ms: through DBOS's queue / Longhaul's submit to finished_at",
                 h.fmt(queued_p50, 1), h.fmt(e2e_p50, 1), f"{e2e_p50 / queued_p50:.0%}"],
                ["one 5-step task alone, p50 ms: DBOS started directly (no queue)",
                 h.fmt(h.percentile(peer.direct_e2e_ms, 50), 1), "", ""],
                [f"write-ahead log a step, bytes, server-wide (median of {rounds}; the submission included)",
                 h.fmt(dbos_wal, 0), h.fmt(lh_wal, 0), f"{lh_wal / dbos_wal:.0%}"],
            ])
            + f"\n\nDBOS rounds: {', '.join(h.fmt(r, 0) for r in peer.steps_per_second)} steps/s. {peer.note}. "
              f"Write-ahead log a step, each round: DBOS {', '.join(h.fmt(w, 0) for w in peer.wal_bytes_per_step)}; "
              f"Longhaul {', '.join(h.fmt(r.wal_bytes_per_step, 0) for r in results)} bytes (the server's, read around "
              "each round: whatever else ran on it counts, and so does a checkpoint's burst of full-page images). "
              "DBOS ran after Longhaul's cluster had stopped. Both are timed from the commit of the submission "
              "to the rows' own end times.")
        report.targets += [
            h.Target("Longhaul steps/s >= DBOS steps/s (same run)", f"{lh:.0f} vs {dbos_rate:.0f}/s = "
                     f"{lh / dbos_rate:.0%}", lh >= dbos_rate),
            h.Target("5-step task p50 <= DBOS's through its queue", f"{e2e_p50:.0f} vs {queued_p50:.0f} ms",
                     e2e_p50 <= queued_p50),
        ]

    loaded = [g for r in results for g in r.loaded_gaps_ms]
    worker_ms_lh = workers * 1000 / lh
    worker_ms_raw = workers * 1000 / raw
    report.add("Cost per step (milliseconds)", h.table(
        ["measure", "p50", "p99", "samples"],
        [
            ["checkpoint-to-checkpoint gap, one task alone (runtime cost of a step)", h.fmt(h.percentile(gaps, 50), 2),
             h.fmt(h.percentile(gaps, 99), 2), len(gaps)],
            ["`advance` in-process, one step per call, no broker", h.fmt(h.percentile(times, 50), 2),
             h.fmt(h.percentile(times, 99), 2), len(times)],
            ["`advance` in-process of a step that asks for calls (a research task's first: its plan)",
             h.fmt(h.percentile(asking_times, 50), 2), h.fmt(h.percentile(asking_times, 99), 2), len(asking_times)],
            ["5-step task alone, submit commit to finished_at", h.fmt(h.percentile(e2e, 50), 1),
             h.fmt(h.percentile(e2e, 99), 1), len(e2e)],
            ["checkpoint gap under load (includes waiting for a worker)", h.fmt(h.percentile(loaded, 50), 1),
             h.fmt(h.percentile(loaded, 99), 1), len(loaded)],
        ])
        + f"\n\nWorker time per unit under load (workers x elapsed / units): Longhaul {worker_ms_lh:.2f} ms a step, "
          f"raw django-q2 {worker_ms_raw:.2f} ms a message: the runtime adds {worker_ms_lh - worker_ms_raw:.2f} ms "
          f"of worker time per step over the bare transport.")
    kept = ("not measured: work waiting in the broker made every step yield" if kept_statements is None else
            f"median {h.median(kept_statements):.0f} (max {max(kept_statements)})")
    report.add("SQL statements per step (BEGIN and COMMIT included)", h.table(
        ["step", "statements"],
        [
            ["a step run in place (the worker kept the lease): probe for waiting work, the fenced commit", kept],
            [("a step when the worker goes on to the task due longest (no broker): the claim from the task table "
              "(which brings the checkpoint, the last step's calls and what else waits, the probe's answer), the "
              f"fenced commit; {TASKS_GOING_ON} tasks of {steps} steps, their ends and the turn's first claim and last "
              "look included"),
             f"mean {switching_statements:.1f}"],
            [("a step after a kick: claim (with the checkpoint, the last step's calls and what else waits), fenced "
              "commit, next kick"), f"median {h.median(statements):.0f} (min {min(statements)}, max {max(statements)})"],
            [("a step that asks for calls, after a kick: claim, the fenced statement (the move, its checkpoint and "
              "events, the calls while none of their pools is paused, and their gateway kick while no job holds the "
              "turn), the turn's last look"),
             f"median {h.median(asking_statements):.0f} (max {max(asking_statements)})"],
        ]))
    report.add("Wake-ups", h.table(
        ["measure", "p50", "p99", "samples"],
        [["a commit handing a wake-up to the process's sender (µs)", h.fmt(h.percentile(handoff_us, 50), 1),
          h.fmt(h.percentile(handoff_us, 99), 1), len(handoff_us)]])
        + f"\n\nWake-ups the workers logged as failed during the run: {wakeup_failures}.")

    p50_gap = h.percentile(gaps, 50)
    report.targets += [
        h.Target("no-op step throughput >= 70% of raw django-q2 (same workers)",
                 f"{lh:.0f} vs {raw:.0f}/s = {lh / raw:.0%}", lh / raw >= RATIO_TARGET),
        h.Target("runtime overhead per step < 5 ms p50",
                 f"{p50_gap:.2f} ms (checkpoint gap, task alone); {worker_ms_lh - worker_ms_raw:.2f} ms worker "
                 f"time over raw django-q2 under load", p50_gap < OVERHEAD_TARGET_MS),
        h.Target("every task succeeded", f"{failed} did not", failed == 0),
        h.Target(f"<= {STATEMENTS_TARGET} statements a step (run in place; asking for calls, after a kick)",
                 f"{kept}; {max(asking_statements)} at most",
                 kept_statements is not None and max(kept_statements, default=0) <= STATEMENTS_TARGET
                 and max(asking_statements) <= STATEMENTS_TARGET),
        h.Target(f"a commit spends < {WAKEUP_HANDOFF_TARGET_US / 1000:g} ms handing over its wake-up (p99)",
                 f"{h.percentile(handoff_us, 99):.1f} µs", h.percentile(handoff_us, 99) < WAKEUP_HANDOFF_TARGET_US),
        h.Target("no wake-up errors", f"{wakeup_failures} logged", wakeup_failures == 0),
    ]
    if peer is not None:
        total, partial = _index_counts(Task._meta.db_table)
        heading = "Why Longhaul's steps/s stay below DBOS's" if lh < dbos_rate else "What a Longhaul step costs"
        report.notes.append(
            f"{heading}: under load a step costs {worker_ms_lh:.1f} ms of worker time "
            f"here. A worker going on from task to task sends {switching_statements:.1f} statements a step (each task's "
            "end included): the one-statement claim, which also brings the checkpoint, the calls the step before "
            "asked for and what else waits for a worker (so the step after it sends no probe of its own); the fenced "
            "commit, one UPDATE that also writes the checkpoint and the events and commits alone (no BEGIN or COMMIT: "
            "transitions.commits_alone). The claim reads task_due_idx in its own order (due time, then id) and "
            "stops at the first row nobody holds. Each UPDATE of the "
            f"task row also writes an entry into each of the table's indexes whose condition the row meets ({total} "
            f"indexes, {partial} of them partial), since the due time and the lease columns are indexed and no update "
            "is HOT; the write-ahead log a step "
            f"says the same ({h.fmt(lh_wal, 0)} bytes against DBOS's {h.fmt(dbos_wal, 0)}). "
            "A DBOS step writes one row. On this shared 2-core machine the ratio moves by about 20% from run to run "
            "(both sides' rounds vary). "
            f"What would {'open a' if lh < dbos_rate else 'widen the'} lead: the lease and due-time columns in a "
            "narrow table of their own (HOT updates of the task row), and several tasks' steps committed together "
            "(one flush of the write-ahead log for a batch of steps).")
        report.notes.append(
            f"Each Longhaul round and each DBOS round started with VACUUM (ANALYZE) of the tables it writes, as "
            f"autovacuum would have run between two bursts: this server runs with autovacuum "
            f"{h.autovacuum_setting()}. Without it a round inherits the dead rows of the rounds before, and the "
            "planner keeps the statistics of the empty tables the run started with (it then planned Longhaul's "
            "claim as a bitmap scan of every due row).")
        report.notes.append(
            f"Why one task alone takes longer: its 5 steps take about {5 * p50_gap:.0f} ms ({p50_gap:.1f} ms each). "
            f"The rest of its {e2e_p50:.0f} ms is django-q2 taking its first kick from the broker (its pusher wakes "
            "when the kick commits, tasks/broker.py) and handing it to a worker process; DBOS's queue polls every "
            "50 ms, so its figure moves by up to that from run to run with where the enqueue falls in its poll.")
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=100)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=4, help="rounds of each side; the median is reported (the machine is shared: rounds vary)")
    parser.add_argument("--solo", type=int, default=20, help="5-step tasks run one at a time")
    parser.add_argument("--timeout", type=float, default=300, help="seconds allowed for one phase")
    args = parser.parse_args()
    for name, limit in LIMITS.items():
        if not 0 < getattr(args, name) <= limit:
            parser.error(f"--{name} must be above 0 and at most {limit}")
    report = run(tasks=args.tasks, steps=args.steps, workers=args.workers, rounds=args.rounds, solo_tasks=args.solo,
                 timeout=args.timeout)
    print()
    print(report.markdown())


if __name__ == "__main__":
    main()
