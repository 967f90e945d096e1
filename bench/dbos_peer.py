"""DBOS Transact measured on this machine, to stand beside Longhaul's checkpointed-step throughput.

    DATABASE_URL=postgres://longhaul:longhaul@127.0.0.1:5432/longhaul_dbospeer \\
        .venv/bin/python bench/dbos_peer.py --workflows 100 --steps 5 --processes 2 --rounds 2

The workload mirrors bench/throughput.py's: a workflow of S steps, each a `@DBOS.step()` that
does nothing but return a small int, so every step costs exactly one DBOS checkpoint.

- Throughput: P worker processes (real OS processes, this file run with --worker) launch DBOS
  and dequeue from one DBOS queue. The parent enqueues N workflows through a `DBOSClient`, in
  one transaction as Longhaul's submit does; steps/s = N*S / (first enqueue -> last workflow
  seen finished). One warm-up batch first, so imports and connections are not in the figure.
- Queued latency: one workflow alone, enqueued through the same queue, to its result.
- Direct latency: one workflow alone, `DBOS.start_workflow(...).get_result()`, in a process that
  has launched DBOS and listens to no queue (run before the workers start, on an idle machine).

Queue configuration: `worker_concurrency=4` and `polling_interval_sec=0.05` (Longhaul's broker
poll). A DBOS worker claims queued workflows only when its poll fires; with one workflow at a
time (as a django-q2 worker runs one task) that caps each worker at one workflow per 50 ms, 200
steps/s for two workers, and DBOS measured 126-130 steps/s so. Four at a time was its best here
(about 179 steps/s, 73 ms through the queue; unlimited: 158 steps/s, 141 ms), so the peer runs at
its best, not at our constraint. `--worker-concurrency` and `--poll` try others; the note in the
figures always says which setting was used.

The parent waits by polling workflow status (every 5 ms for a lone workflow, 20 ms for a batch):
a DBOS client handle's get_result() polls once a second by default and has no timeout. The times
are not the polls': each clock starts once the enqueue has committed and stops at the workflow's own
end time (workflow_status.updated_at), as Longhaul's start after the submit commit and stop at
the tasks' finished_at.

DBOS's system database is `<name>_dbos` next to DATABASE_URL's database (same server and
credentials; only loopback hosts are accepted). It is dropped before a run, if a crashed run
left it, and dropped at the end, so every run starts from empty tables and leaves nothing.
No Django here: this module must run without Django settings.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dbos import DBOSClient, WorkflowHandle

APP = "longhaul-dbos-peer"
QUEUE = "bench"
WORKFLOW = "bench_steps"
APP_VERSION = "bench"  # fixed, so every process dequeues the client's version-less workflows
POLL_SEC = 0.05  # Longhaul's django-q2 broker poll (LONGHAUL_Q_POLL default)
WORKER_CONCURRENCY: int | None = 4  # DBOS's best here (module docstring)
RESULT_POLL_SEC = 0.005  # a lone workflow: fine-grained, it is the figure
ROUND_POLL_SEC = 0.02  # a batch: as bench/throughput.py polls, leaving the 2 cores to the workers
LOOPBACK = {None, "", "127.0.0.1", "localhost", "::1"}
TERMINAL_FAILURES = {"ERROR", "CANCELLED", "MAX_RECOVERY_ATTEMPTS_EXCEEDED"}


@dataclass
class DbosFigures:
    steps_per_second: list[float]  # one per round: S-step workflows through a DBOS queue, P processes
    queued_e2e_ms: list[float]  # one workflow alone, enqueue -> result, through the queue
    direct_e2e_ms: list[float]  # one workflow alone, DBOS.start_workflow -> result
    version: str
    note: str = ""
    wal_bytes_per_step: list[float] = field(default_factory=list)  # per round: WAL bytes a step, enqueue included


def available() -> str | None:
    """None when dbos can be imported; otherwise a one-line reason."""
    try:
        import dbos  # noqa: F401
    except ImportError as exc:
        return f"dbos is not installed ({exc}): pip install -e .[bench]"
    return None


def dbos_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("dbos")
    except PackageNotFoundError:
        return "unknown"


def system_database_url(database_url: str) -> str:
    """`<name>_dbos` on the same server with the same credentials, as a SQLAlchemy URL string."""
    from sqlalchemy import make_url

    url = make_url(database_url)
    if url.host not in LOOPBACK:
        raise ValueError(f"refusing non-loopback database host {url.host!r}")
    if not url.database:
        raise ValueError("DATABASE_URL names no database")
    return url.set(drivername="postgresql", database=f"{url.database}_dbos").render_as_string(hide_password=False)


# --- child processes ------------------------------------------------------------------


def _launch(sys_url: str, executor_id: str, *, listen: bool) -> Callable[[int], int]:
    """Register the workflow, then launch DBOS; returns the workflow function."""
    from dbos import DBOS, DBOSConfig

    @DBOS.step(name="bench_noop")
    def noop(i: int) -> int:
        return i

    @DBOS.workflow(name=WORKFLOW)
    def steps_workflow(steps: int) -> int:
        return sum(noop(i) for i in range(steps))

    config: DBOSConfig = {
        "name": APP,
        "system_database_url": sys_url,
        # Distinct per process: with the shared default ("local") a launching process would
        # "recover" workflows its peer is running.
        "executor_id": executor_id,
        "application_version": APP_VERSION,
        "log_level": "WARNING",
    }
    DBOS(config=config)
    if not listen:
        DBOS.listen_queues([])
    DBOS.launch()
    return steps_workflow


def _worker(sys_url: str, index: int, worker_concurrency: int | None, poll: float) -> None:
    """Dequeue from the bench queue until the parent closes our stdin."""
    from dbos import DBOS

    _launch(sys_url, f"bench-worker-{index}", listen=True)
    DBOS.register_queue(QUEUE, worker_concurrency=worker_concurrency, polling_interval_sec=poll,
                        on_conflict="always_update")
    # The queue manager starts a queue's polling thread within a second of its registration;
    # "ready" must mean this process is already polling, or round one would start lopsided.
    deadline = time.monotonic() + 30
    while not any(t.name == f"queue-worker-{QUEUE}" for t in threading.enumerate()):
        if time.monotonic() > deadline:
            raise SystemExit("the queue thread did not start within 30 s")
        time.sleep(0.02)
    print("ready", flush=True)
    sys.stdin.read()
    DBOS.destroy()


def _direct(sys_url: str, solo: int, steps: int) -> None:
    """Print, as JSON, `solo` end-to-end times (ms) of the workflow started directly."""
    from dbos import DBOS

    workflow = _launch(sys_url, "bench-direct", listen=False)
    samples = []
    for n in range(3 + solo):  # the first 3 warm connections and code paths
        started = time.perf_counter()
        result = DBOS.start_workflow(workflow, steps).get_result()
        elapsed = (time.perf_counter() - started) * 1000
        assert result == sum(range(steps)), result
        if n >= 3:
            samples.append(elapsed)
    print(json.dumps(samples), flush=True)
    DBOS.destroy()


def _child_env() -> dict[str, str]:
    # DBOS__* variables would switch on DBOS Cloud / Conductor behaviour (and network traffic).
    return {k: v for k, v in os.environ.items() if not k.startswith("DBOS__")}


def _child_command(*args: str) -> list[str]:
    return [sys.executable, os.path.abspath(__file__), *args]


# --- parent ---------------------------------------------------------------------------


def _psycopg_url(url: str) -> str:
    from sqlalchemy import make_url

    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


def _recreate_database(database_url: str, name: str, *, create: bool) -> None:
    """Drop `name` (and its lingering sessions); create it afresh when asked."""
    import psycopg
    from psycopg import sql

    with psycopg.connect(_psycopg_url(database_url), autocommit=True, connect_timeout=10) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
        if create:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))


@contextmanager
def _workers(sys_url: str, processes: int, worker_concurrency: int | None, poll: float,
             timeout: float) -> Iterator[list[subprocess.Popen[str]]]:
    """Started worker processes, all polling the queue; always stopped on exit."""
    procs: list[subprocess.Popen[str]] = []
    try:
        for index in range(processes):
            args = ["--worker", sys_url, "--index", str(index), "--poll", str(poll),
                    "--worker-concurrency", str(worker_concurrency or 0)]
            procs.append(subprocess.Popen(_child_command(*args), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                          text=True, env=_child_env()))
        deadline = time.monotonic() + timeout
        for proc in procs:
            assert proc.stdout is not None
            readable, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
            if not readable or proc.stdout.readline().strip() != "ready":
                raise RuntimeError(f"DBOS worker {proc.pid} did not get ready (exit code {proc.poll()})")
        yield procs
    finally:
        for proc in procs:
            if proc.stdin is not None:
                proc.stdin.close()  # the worker's cue to DBOS.destroy() and exit
        for proc in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


def _wait(handles: list[WorkflowHandle[int]], expected: int, deadline: float, interval: float) -> float:
    """Block until every handle's workflow succeeded with `expected`; raise on failure or timeout.
    Returns when the last one ended, from DBOS's own row (updated_at, epoch ms), as Longhaul's figures
    take a task's finished_at: the polling here adds nothing to the measure."""
    ended = 0.0
    for handle in handles:
        while True:
            status = handle.get_status()
            if status.status == "SUCCESS":
                if status.output != expected:
                    raise RuntimeError(f"workflow {handle.get_workflow_id()} returned {status.output!r}")
                ended = max(ended, (status.updated_at or 0) / 1000)
                break
            if status.status in TERMINAL_FAILURES:
                raise RuntimeError(f"workflow {handle.get_workflow_id()} ended {status.status}: {status.error}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"workflow {handle.get_workflow_id()} still {status.status} at the timeout")
            time.sleep(interval)
    return ended


def _enqueue(client: DBOSClient, engine: Any, count: int, steps: int) -> list[WorkflowHandle[int]]:
    """`count` workflows enqueued in one transaction, as Longhaul submits its batch."""
    with engine.begin() as conn:
        return [client.enqueue_in_transaction(conn, {"queue_name": QUEUE, "workflow_name": WORKFLOW}, steps)
                for _ in range(count)]


def run(*, database_url: str, workflows: int = 100, steps: int = 5, processes: int = 2, rounds: int = 2,
        solo: int = 20, timeout: float = 300, worker_concurrency: int | None = WORKER_CONCURRENCY,
        poll: float = POLL_SEC) -> DbosFigures:
    """Measure DBOS on a fresh `<name>_dbos` database, dropped again at the end."""
    import sqlalchemy as sa
    from dbos import DBOSClient

    sys_url = system_database_url(database_url)
    sys_name = sa.make_url(sys_url).database
    assert sys_name is not None
    expected = sum(range(steps))
    _recreate_database(database_url, sys_name, create=True)
    try:
        # Alone on the machine, and it runs DBOS's migrations before the workers launch.
        direct = subprocess.run(_child_command("--direct", sys_url, "--solo", str(solo), "--steps", str(steps)),
                                stdout=subprocess.PIPE, text=True, env=_child_env(), timeout=timeout, check=True)
        direct_ms: list[float] = json.loads(direct.stdout.strip().splitlines()[-1])

        client = DBOSClient(system_database_url=sys_url, application_name=APP)
        engine = sa.create_engine(sa.make_url(sys_url).set(drivername="postgresql+psycopg"), poolclass=sa.NullPool)
        try:
            with _workers(sys_url, processes, worker_concurrency, poll, timeout):
                _wait(_enqueue(client, engine, 2 * processes, steps), expected, time.monotonic() + timeout,
                      ROUND_POLL_SEC)
                # Each clock starts once the enqueue has committed (Longhaul's: once its submit has) and
                # stops at the last workflow's own end time.
                rates, wal = [], []
                for _ in range(rounds):
                    _vacuum_analyze(engine)  # as Longhaul's rounds are (bench/throughput.py)
                    wal_before = _wal_position(engine)
                    handles = _enqueue(client, engine, workflows, steps)
                    started = time.time()
                    ended = _wait(handles, expected, time.monotonic() + timeout, ROUND_POLL_SEC)
                    rates.append(workflows * steps / (ended - started))
                    wal.append((_wal_position(engine) - wal_before) / (workflows * steps))
                queued_ms = []
                for _ in range(solo):
                    handle = client.enqueue({"queue_name": QUEUE, "workflow_name": WORKFLOW}, steps)
                    started = time.time()
                    ended = _wait([handle], expected, time.monotonic() + timeout, RESULT_POLL_SEC)
                    queued_ms.append((ended - started) * 1000)
        finally:
            client.destroy()
            engine.dispose()
    finally:
        _recreate_database(database_url, sys_name, create=False)

    concurrency = "unlimited" if worker_concurrency is None else str(worker_concurrency)
    note = (f"DBOS {dbos_version()}, {processes} worker processes on one queue with worker_concurrency="
            f"{concurrency} and polling_interval_sec={poll}; {workflows} workflows of {steps} no-op steps "
            f"enqueued in one transaction by a DBOSClient; timed from the enqueue's commit to the last "
            f"workflow's own end (its updated_at); system database {sys_name} (dropped after the run)")
    return DbosFigures(steps_per_second=rates, queued_e2e_ms=queued_ms, direct_e2e_ms=direct_ms,
                       version=dbos_version(), note=note, wal_bytes_per_step=wal)


def _vacuum_analyze(engine: Any) -> None:
    """VACUUM (ANALYZE) of the system database, as autovacuum would have run between two rounds."""
    import sqlalchemy as sa

    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(sa.text("VACUUM (ANALYZE)"))


def _wal_position(engine: Any) -> int:
    """Bytes of write-ahead log the server has generated so far, for all its databases (as _harness.wal_position)."""
    import sqlalchemy as sa

    with engine.connect() as conn:
        return int(conn.execute(sa.text("SELECT pg_current_wal_insert_lsn() - '0/0'::pg_lsn")).scalar_one())


def _summary(samples: list[float]) -> str:
    ordered = sorted(samples)
    p90 = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
    return f"p50 {statistics.median(ordered):.1f}, p90 {p90:.1f}, max {ordered[-1]:.1f} ms ({len(ordered)} samples)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workflows", type=int, default=100)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--solo", type=int, default=20)
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--worker-concurrency", type=int, default=WORKER_CONCURRENCY,
                        help="per-process limit; 0 for none (default %(default)s)")
    parser.add_argument("--poll", type=float, default=POLL_SEC, help="queue polling interval, s (default %(default)s)")
    # Internal: how run() starts its child processes.
    parser.add_argument("--worker", metavar="SYSTEM_DB_URL", help=argparse.SUPPRESS)
    parser.add_argument("--direct", metavar="SYSTEM_DB_URL", help=argparse.SUPPRESS)
    parser.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    concurrency = args.worker_concurrency or None
    if args.worker:
        _worker(args.worker, args.index, concurrency, args.poll)
        return
    if args.direct:
        _direct(args.direct, args.solo, args.steps)
        return

    reason = available()
    if reason:
        raise SystemExit(reason)
    database_url = os.environ.get("DATABASE_URL")
    if not database_url:
        raise SystemExit("set DATABASE_URL, e.g. postgres://longhaul:longhaul@127.0.0.1:5432/longhaul_dbospeer")
    figures = run(database_url=database_url, workflows=args.workflows, steps=args.steps, processes=args.processes,
                  rounds=args.rounds, solo=args.solo, timeout=args.timeout, worker_concurrency=concurrency,
                  poll=args.poll)
    print(f"DBOS Transact {figures.version}")
    rates = ", ".join(f"{rate:.0f}" for rate in figures.steps_per_second)
    print(f"steps/s per round: {rates} (median {statistics.median(figures.steps_per_second):.0f})")
    print(f"{args.steps}-step workflow alone, through the queue: {_summary(figures.queued_e2e_ms)}")
    print(f"{args.steps}-step workflow alone, started directly: {_summary(figures.direct_e2e_ms)}")
    print(figures.note)


if __name__ == "__main__":
    main()
