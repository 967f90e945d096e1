"""10,000 active tasks: step start after a task is due, the sweeper's pass, worker memory and
database connections, while thousands of tasks wait on slow remote work, on one machine with a
qcluster of 2 worker processes (the issue "The hot path", item "10,000 active tasks").

    DATABASE_URL=postgres://longhaul:longhaul@127.0.0.1:5432/longhaul_bench \\
        .venv/bin/python bench/active_tasks.py --tasks 10000

The slow remote work: the loopback MCP task server of the tests (tests/fakes/mcp_task_server.py,
over streamable HTTP, started as the tests start it), whose `slow_report` tasks here take two
hours and ask to be polled every --poll-seconds (default an hour: longer than the run, so the
idle tasks are idle). The idle tasks are `mcp` tasks waiting on such a remote task: running,
waiting_reason "tool", no lease, no due time, their next tasks/get a pending operation due an
interval later, as tasks/drivers/mcp.py leaves them.

How they are made: 10 seed tasks go through the real path (actions.submit, then the cluster
runs their first step, the gateway's tools/call on the fake, and the step that reads its handle
and requests the next poll); once each waits on that poll, the rest are copies of the seeds,
bulk_create'd in batches of 1,000, each batch in one transaction: the task row (a new public id
and remote handle, so the one-active-task-per-handle constraint holds), its checkpoints (the
handle in their state), its operations (new keys; the handle in args, result and args_digest)
and its events. A copy is as old as a real idle task: all its times are the seed's, moved so
that its last poll finished, and its pending poll was requested, a random time up to half an
interval ago; its next poll is due an interval after that (so with the default, none during
the run; a --poll-seconds shorter than twice the run makes idle tasks poll during it, about
N / poll-seconds a second once they start). The age matters: liveness.orphaned_operations
looks further at pending calls older than an operation lease. Each copy's remote task also
exists on the fake (its record file written beside the seed's, equally aged), so a poll of any
of them would be answered. After each growth the tables are VACUUM ANALYZEd, as autovacuum
would have done. AdmissionRecord rows are not copied (a log, read by no measured path). The
tenant's max_running and LONGHAUL_MAX_RUNNING (here and in the cluster's environment) leave
room for every task.

With one qcluster of --workers worker processes (h.qcluster: `manage.py worker` and the chat
worker beside it) running throughout, at 0, N/10 and N idle tasks in turn (0, 1,000 and
10,000 by default), each phase measures:

- step start after a task is due: --probes `sleep` tasks (1 step of 0 s) of the same tenant,
  submitted one at a time every --interval s through actions.submit. Submission admits a probe
  at once (next_run_at = the admission's time, AdmissionRecord.admitted_at); its step starts
  when a worker claims it (transitions.claim writes AdmissionRecord.started_at). The latency
  is started_at - admitted_at, measured from the admission's clock read, a few ms before
  its commit, so it slightly overstates. Five probes first warm the workers (not counted).
  The same at 0 idle tasks, in the same run, is the baseline.
- remote results (reference): --mcp-probes `mcp` tasks submitted among the sleep probes, whose
  remote tasks take 3 s and ask for polls every second (LONGHAUL_MCP_POLL_FLOOR_MS's 1 s
  default): for each call (tools/call, tasks/get), from its result being recorded (which makes
  the next step due) to the next step's commit (the next call's created_at, or the task's
  finished_at), and from the call being due (not_before, else created_at) to a gateway job
  claiming it.
- the sweeper's pass: tasks.sweeper.run_once in this process, --sweeps times after 2 warm-up
  passes, once the probes have ended (the idle tasks alone). Then its parts one by one, and
  the liveness rules' queries, 5 times each, for the breakdown.
- worker memory: VmRSS from /proc/<pid>/status of every process of the task cluster, every
  second (psutil is not installed), with the roles the cluster's guard logs ("workers [...],
  pusher ..., monitor ..."; a worker it respawns later is a child of the guard it did not
  name), and VmHWM (peak RSS) of each at the end.
- database connections: `SELECT count(*) FROM pg_stat_activity WHERE datname =
  current_database()` every second (on a connection of the sampler's own), and who holds
  them: each session's client port mapped to the process owning the socket
  (/proc/net/tcp, /proc/<pid>/fd): the task cluster, the chat cluster, this process.

Bounded in time (--timeout for the whole run; a phase not reached is reported as such),
loopback only; every row made is deleted at the end (Scope.purge), the fake's state
directory removed, and the MCP server and the cluster stopped, also after a failure.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import secrets
import shutil
import tempfile
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import _harness as h
import psycopg
from _processes import descendants, processes, pss_kb, status_kb
from django.conf import settings
from django.db import connection, transaction

from tasks import actions, clock, liveness, notifications, retention, sweeper
from tasks.context import digest
from tasks.models import AdmissionRecord, Checkpoint, Operation, Task, TaskEvent
from tasks.statuses import TERMINAL, OperationStatus, TaskStatus
from tests.fakes.mcp_task_server import SERVER_NAME, McpTaskServer, write_servers_file

STEP_START_TARGET_MS = 1000.0
FLAT_TARGET = 1.5
SEEDS = 10
BATCH = 1000
WARM_PROBES = 5
REMOTE_TOOL = "slow_report"
PROBE_REMOTE_SECONDS = 3
PROBE_POLL_MS = 1000
LIMITS = {"tasks": 100_000, "probes": 2000, "mcp_probes": 200, "interval": 10.0, "sweeps": 500,
          "poll_seconds": 6 * 3600, "workers": 8, "timeout": 3600}
GUARD_LINE = re.compile(r"worker cluster running under pid (\d+): workers \[([\d, ]*)\], pusher (\d+), monitor (\d+)")
PG_PORT = 5432


# --- the processes: memory and connections -------------------------------------------------


def chat_cluster_pid() -> int | None:
    """The chat worker (`manage.py worker --queue chat`) h.qcluster started beside the task cluster."""
    me = os.getpid()
    return next((proc.pid for proc in processes() if proc.ppid == me and proc.is_chat_service), None)


class Sampler(threading.Thread):
    """Every `interval` s: RSS of the task cluster's processes by role, and the database's sessions by owner,
    each kept as its maximum per phase (`phase`, set by the main thread)."""

    def __init__(self, cluster: Any, *, interval: float = 1.0) -> None:
        super().__init__(name="bench-sampler", daemon=True)
        self.cluster, self.interval = cluster, interval
        self.chat_pid = chat_cluster_pid()
        self.phase = "start"
        self.stopping = threading.Event()
        self.roles: dict[int, str] = {}
        self._log_chars = -1
        self.rss: dict[str, dict[int, int]] = defaultdict(dict)  # phase -> pid -> max kB
        self.tree_kb: Counter[str] = Counter()  # phase -> max kB, PSS of the task cluster's processes together
        self.chat_kb: Counter[str] = Counter()
        self.sessions: dict[str, Counter[str]] = defaultdict(Counter)  # phase -> owner -> max sessions
        self.per_process: dict[str, Counter[int]] = defaultdict(Counter)  # phase -> pid -> max sessions
        self.hwm: dict[int, int] = {}
        self.other_kinds: set[str] = set()  # pg_stat_activity.backend_type of the sessions no process here owns
        self.errors: list[str] = []
        self.samples = 0
        s = connection.settings_dict
        self.params = {"host": s["HOST"] or "127.0.0.1", "port": s["PORT"] or PG_PORT, "user": s["USER"],
                       "password": s["PASSWORD"], "dbname": s["NAME"]}

    def _refresh_roles(self) -> None:
        """The roles the guard logged ("workers [...], pusher ..., monitor ..."), read again when its log grew;
        a named role replaces one inferred before the line was read."""
        text = self.cluster.output()
        if len(text) == self._log_chars:
            return
        self._log_chars = len(text)
        for match in GUARD_LINE.finditer(text):
            self.roles[int(match[1])] = "main"
            self.roles.update({int(p): "worker" for p in match[2].replace(" ", "").split(",") if p})
            self.roles[int(match[3])], self.roles[int(match[4])] = "pusher", "monitor"

    def role(self, pid: int, parents: dict[int, int]) -> str:
        if pid not in self.roles:
            parent = parents.get(pid, 0)
            if pid == self.cluster.pid:
                self.roles[pid] = "main"
            elif parent == self.cluster.pid:
                self.roles[pid] = "guard"
            elif parents.get(parent) == self.cluster.pid:
                # A child of the guard it did not name: a worker it started since (django-q2 recycles a worker
                # after `recycle` jobs, 500 by default, and replaces one that died).
                self.roles[pid] = "worker"
            else:
                self.roles[pid] = "other"
        return self.roles[pid]

    def run(self) -> None:
        try:
            db = psycopg.connect(autocommit=True, **self.params)
        except psycopg.Error as exc:
            self.errors.append(f"the sampler could not connect: {exc}")
            return
        try:
            while not self.stopping.wait(self.interval):
                try:
                    self.sample(db)
                except psycopg.OperationalError as exc:  # the database restarted (a drill elsewhere)
                    self.errors.append(str(exc).splitlines()[0])
                    db.close()
                    db = psycopg.connect(autocommit=True, **self.params)
                except (OSError, ValueError, psycopg.Error) as exc:  # a process ended mid-read, say: skip it
                    self.errors.append(f"{type(exc).__name__}: {exc}")
        finally:
            db.close()

    def sample(self, db: psycopg.Connection) -> None:
        phase = self.phase
        procs = processes()
        parents = {proc.pid: proc.ppid for proc in procs}
        self._refresh_roles()
        tree = [self.cluster.pid, *descendants(self.cluster.pid, procs)]
        chat = [self.chat_pid, *descendants(self.chat_pid, procs)] if self.chat_pid else []
        total = 0
        for pid in tree:
            kb = status_kb(pid, "VmRSS")
            if kb is None:
                continue
            total += pss_kb(pid)
            self.role(pid, parents)
            self.rss[phase][pid] = max(self.rss[phase].get(pid, 0), kb)
            self.hwm[pid] = max(self.hwm.get(pid, 0), status_kb(pid, "VmHWM") or 0)
        self.tree_kb[phase] = max(self.tree_kb[phase], total)
        self.chat_kb[phase] = max(self.chat_kb[phase], sum(pss_kb(pid) for pid in chat))
        rows = db.execute("SELECT client_port, backend_type FROM pg_stat_activity "
                          "WHERE datname = current_database()").fetchall()
        ports = {port for port, _ in rows if port is not None}
        owners = h.socket_owners(int(self.params["port"]), ports, [*tree, *chat, os.getpid()])
        counts: Counter[str] = Counter(total=len(rows))
        mine: Counter[int] = Counter()
        for port, backend_type in rows:
            pid = owners.get(port)
            if pid in tree:
                counts["task cluster"] += 1
                mine[pid] += 1
            elif pid in chat:
                counts["chat cluster"] += 1
            elif pid == os.getpid():
                counts["this process"] += 1
            else:
                counts["other"] += 1
                self.other_kinds.add(backend_type or "unknown")
        for owner, n in counts.items():
            self.sessions[phase][owner] = max(self.sessions[phase][owner], n)
        for pid, n in mine.items():
            self.per_process[phase][pid] = max(self.per_process[phase][pid], n)
        self.samples += 1


# --- the idle tasks -----------------------------------------------------------------------


def remote_arguments(topic: str, *, seconds: float, poll_ms: int, ttl_ms: int) -> dict[str, Any]:
    return {"topic": topic, "seconds": seconds, "poll_ms": poll_ms, "ttl_ms": ttl_ms}


def submit_seeds(scope: h.Scope, count: int, *, poll_seconds: float) -> list[int]:
    """Idle tasks through the real path: the cluster runs them until each waits on its next poll."""
    seconds = max(2 * 3600, 4 * poll_seconds)
    ttl_ms = int((seconds + 3 * poll_seconds) * 1000)
    ids = []
    for n in range(count):
        spec = {"server": SERVER_NAME, "tool": REMOTE_TOOL, "arguments": remote_arguments(
            f"seed {n}", seconds=seconds, poll_ms=int(poll_seconds * 1000), ttl_ms=ttl_ms)}
        task, _ = actions.submit(tenant=scope.tenant, user=scope.user, submission=actions.Submission(
            kind="mcp", name=f"idle seed {n}", input=spec))
        ids.append(task.pk)
    return ids


def waiting_on_a_poll(ids: list[int]) -> int:
    """How many of these tasks wait, holding nothing, on a pending tasks/get of their last step."""
    tasks = dict(Task.objects.filter(pk__in=ids, status=TaskStatus.RUNNING, waiting_reason="tool", lease_owner="",
                                     next_run_at__isnull=True, remote_handle__isnull=False)
                 .values_list("pk", "current_step"))
    polls = Operation.objects.filter(task_id__in=list(tasks), name="tasks/get", status=OperationStatus.PENDING) \
        .values_list("task_id", "step")
    return len({t for t, step in polls if step == tasks[t] - 1})


def idle_count(scope: h.Scope) -> int:
    """The tenant's tasks waiting on remote work whose next poll is not due yet."""
    return Operation.objects.filter(task__tenant=scope.tenant, task__status=TaskStatus.RUNNING,
                                    task__waiting_reason="tool", name="tasks/get", status=OperationStatus.PENDING,
                                    not_before__gt=clock.now()).values("task_id").distinct().count()


def _with_handle(value: Any, old: str, new: str) -> Any:
    """A JSON value with the remote handle `old` replaced by `new` wherever it is a whole string."""
    if isinstance(value, dict):
        return {k: _with_handle(v, old, new) for k, v in value.items()}
    if isinstance(value, list):
        return [_with_handle(v, old, new) for v in value]
    return new if value == old else value


def _copy(row: Any, *, shift: timedelta, **changes: Any) -> Any:
    """A new unsaved row of the same model with the same column values, its times moved by `shift`, but `changes`."""
    model = type(row)
    values = {}
    for f in model._meta.concrete_fields:
        if f.primary_key:
            continue
        value = getattr(row, f.attname)
        values[f.attname] = value + shift if value is not None and f.get_internal_type() == "DateTimeField" else value
    values.update(changes)
    return model(**values)


def rows_of(seed: Task, handle: str, task: Task, seed_rows: dict[str, list[Any]], *, shift: timedelta) -> list[Any]:
    """Copies of a seed's checkpoints, operations and events for `task`, whose remote handle is `handle`."""
    old = seed.remote_handle
    rows: list[Any] = [_copy(c, shift=shift, task_id=task.pk, state=_with_handle(c.state, old, handle))
                       for c in seed_rows["checkpoints"]]
    for o in seed_rows["operations"]:
        args = _with_handle(o.args, old, handle)
        rows.append(_copy(o, shift=shift, task_id=task.pk, key=o.key.replace(f"{seed.pk}:", f"{task.pk}:", 1),
                          args=args, args_digest=digest(args), result=_with_handle(o.result, old, handle)))
    rows += [_copy(e, shift=shift, task_id=task.pk) for e in seed_rows["events"]]
    return rows


def grow(seed_ids: list[int], count: int, *, state_dir: Path, poll_seconds: float, start: int) -> None:
    """`count` more idle tasks, copies of the seeds (round robin), with remote tasks of their own on the fake.

    Each copy is as old as a real idle task would be: all its times are the seed's, moved so that its last
    poll finished (and its pending poll was requested) a random time up to half an interval ago; its next
    poll is then due an interval after that, as the seed's is."""
    seeds = list(Task.objects.filter(pk__in=seed_ids).order_by("pk"))
    seed_rows: dict[int, dict[str, list[Any]]] = {s.pk: defaultdict(list) for s in seeds}
    for name, model in (("checkpoints", Checkpoint), ("operations", Operation), ("events", TaskEvent)):
        for row in model.objects.filter(task_id__in=seed_ids):
            seed_rows[row.task_id][name].append(row)
    # When each seed requested the poll it waits on: the moment a copy's times are moved to.
    requested = {s.pk: max(o.created_at for o in seed_rows[s.pk]["operations"] if o.status == OperationStatus.PENDING)
                 for s in seeds}
    records = {s.pk: json.loads((state_dir / "tasks" / f"{s.remote_handle}.json").read_text()) for s in seeds}
    made = 0
    while made < count:
        size = min(BATCH, count - made)
        now = clock.now()
        plan = []
        for j in range(size):
            seed = seeds[(made + j) % len(seeds)]
            handle = secrets.token_hex(16)
            shift = now - timedelta(seconds=random.uniform(0, poll_seconds / 2)) - requested[seed.pk]
            plan.append((seed, handle, shift, _copy(seed, shift=shift, public_id=uuid.uuid4(), remote_handle=handle,
                                                    name=f"idle {start + made + j}")))
        # One transaction: a task seen without its pending poll is what the liveness sweep repairs.
        with transaction.atomic():
            Task.objects.bulk_create([task for _, _, _, task in plan])
            rows: list[Any] = []
            for seed, handle, shift, task in plan:
                rows += rows_of(seed, handle, task, seed_rows[seed.pk], shift=shift)
            for model in (Checkpoint, Operation, TaskEvent):
                model.objects.bulk_create([r for r in rows if type(r) is model], batch_size=2000)
        for seed, handle, shift, _ in plan:
            created = records[seed.pk]["created_at"] + shift.total_seconds()
            record = {**records[seed.pk], "id": handle, "created_at": created}
            (state_dir / "tasks" / f"{handle}.json").write_text(json.dumps(record))
        made += size


CHURNED = (Task, Operation, Checkpoint, TaskEvent)  # the tables each growth vacuums


# --- one phase ------------------------------------------------------------------------------


def submit_sleep(scope: h.Scope, name: str) -> int:
    task, _ = actions.submit(tenant=scope.tenant, user=scope.user, submission=actions.Submission(
        kind="sleep", name=name, input={"steps": 1, "step_seconds": 0}))
    return task.pk


def submit_mcp_probe(scope: h.Scope, name: str) -> int:
    task, _ = actions.submit(tenant=scope.tenant, user=scope.user, submission=actions.Submission(
        kind="mcp", name=name, input={"server": SERVER_NAME, "tool": REMOTE_TOOL, "arguments": remote_arguments(
            name, seconds=PROBE_REMOTE_SECONDS, poll_ms=PROBE_POLL_MS, ttl_ms=600_000)}))
    return task.pk


def all_ended(ids: list[int]) -> bool:
    return not Task.objects.filter(pk__in=ids).exclude(status__in=TERMINAL).exists()


def step_starts(ids: list[int]) -> list[float]:
    """Milliseconds from admission (the first step due) to the first claim (the step's start)."""
    return [(started - admitted).total_seconds() * 1000 for admitted, started in
            AdmissionRecord.objects.filter(task_id__in=ids, admitted_at__isnull=False, started_at__isnull=False)
            .values_list("admitted_at", "started_at")]


def remote_waits(ids: list[int]) -> tuple[list[float], list[float]]:
    """For each call of these mcp tasks: result recorded -> next step committed, and due -> claimed (ms)."""
    ended = dict(Task.objects.filter(pk__in=ids).values_list("pk", "finished_at"))
    calls: dict[int, list[tuple]] = defaultdict(list)
    for row in (Operation.objects.filter(task_id__in=ids, mode=Operation.Mode.GATEWAY).exclude(key__contains=":a")
                .order_by("created_at", "id").values_list("task_id", "created_at", "not_before", "started_at",
                                                          "finished_at")):
        calls[row[0]].append(row[1:])
    to_step, to_claim = [], []
    for task_id, rows in calls.items():
        for i, (created, not_before, started, finished) in enumerate(rows):
            if started is not None:
                due = max(created, not_before) if not_before else created
                to_claim.append((started - due).total_seconds() * 1000)
            if finished is None:
                continue
            committed = rows[i + 1][0] if i + 1 < len(rows) else ended.get(task_id)
            if committed is not None and committed >= finished:
                to_step.append((committed - finished).total_seconds() * 1000)
    return to_step, to_claim


def sweeper_parts() -> dict[str, Callable[[Any], Any]]:
    """tasks.sweeper.run_once's parts, and the liveness rules' queries (read-only), to time one by one."""
    batch = settings.LONGHAUL_SWEEP_BATCH
    return {
        "kick_due": sweeper.kick_due,
        "kick_operations": sweeper.kick_operations,
        "notifications.kick_due": lambda at: notifications.kick_due(at, limit=batch),
        "fail_queue_timeouts": sweeper.fail_queue_timeouts,
        "liveness.repair (all rules)": liveness.repair,
        "liveness rule waits_for_nothing": lambda at: liveness.waits_for_nothing(batch),
        "liveness rule never_due": lambda at: liveness.never_due(batch),
        "liveness rule stop_not_acted_on": lambda at: liveness.stop_not_acted_on(at, batch),
        "liveness rule queued_with_free_slots": lambda at: liveness.queued_with_free_slots(),
        "liveness rule orphaned_operations": lambda at: liveness.orphaned_operations(at, batch),
        "liveness rule notifications_not_due": lambda at: liveness.notifications_not_due(batch),
        "liveness rule notifications_untold": lambda at: liveness.notifications_untold(batch),
        "liveness rule dispatched_runs_ended": lambda at: liveness.dispatched_runs_ended(at, batch),
        "flag_stalled": sweeper.flag_stalled,
        "forget_expired_keys": sweeper.forget_expired_keys,
        "retention.purge": retention.purge,
    }


def time_sweeps(passes: int, *, part_repeats: int = 5) -> tuple[list[float], dict[str, list[float]], Counter]:
    """run_once `passes` times (after 2 unmeasured), then each part `part_repeats` times; milliseconds."""
    counts: Counter[str] = Counter()
    for _ in range(2):
        h.reconnecting(lambda: sweeper.run_once(now=clock.now()))
    whole = []
    for _ in range(passes):
        started = time.perf_counter()
        result = sweeper.run_once(now=clock.now())
        whole.append((time.perf_counter() - started) * 1000)
        counts.update({k: v for k, v in result.items() if v})
    parts: dict[str, list[float]] = defaultdict(list)
    for _ in range(part_repeats):
        for name, part in sweeper_parts().items():
            started = time.perf_counter()
            part(clock.now())
            parts[name].append((time.perf_counter() - started) * 1000)
    return whole, dict(parts), counts


def measure_phase(scope: h.Scope, idle: int, *, probes: int, mcp_probes: int, interval: float, sweeps: int,
                  deadline: float) -> dict[str, Any]:
    warm = [submit_sleep(scope, f"warm {idle} {n}") for n in range(WARM_PROBES)]
    h.wait_until(lambda: all_ended(warm), timeout=max(1.0, deadline - time.monotonic()), interval=0.2,
                 message="the warm-up probes to end")
    sleep_ids, mcp_ids = [], []
    every = max(1, probes // mcp_probes) if mcp_probes else 0
    started = time.monotonic()
    for n in range(probes):
        sleep_ids.append(submit_sleep(scope, f"probe {idle} {n}"))
        if every and n % every == 0 and len(mcp_ids) < mcp_probes:
            mcp_ids.append(submit_mcp_probe(scope, f"remote probe {idle} {n}"))
        time.sleep(max(0.0, started + (n + 1) * interval - time.monotonic()))
    notes = []
    try:
        h.wait_until(lambda: all_ended(sleep_ids + mcp_ids), timeout=max(1.0, deadline - time.monotonic()),
                     interval=0.25, message=f"the probes at {idle:,} idle tasks to end")
    except TimeoutError as exc:
        notes.append(f"{exc}; the figures cover the probes that had started.")
    statuses = Counter(Task.objects.filter(pk__in=sleep_ids + mcp_ids).values_list("status", flat=True))
    to_step, to_claim = remote_waits(mcp_ids)
    idle_now = idle_count(scope)
    whole, parts, counts = time_sweeps(sweeps)
    return {"idle": idle_now, "step_start": step_starts(sleep_ids), "remote_step": to_step,
            "remote_claim": to_claim, "statuses": statuses, "sweeps": whole, "parts": parts,
            "sweep_counts": counts, "notes": notes, "probes": len(sleep_ids), "mcp_probes": len(mcp_ids)}


# --- the benchmark --------------------------------------------------------------------------


def _ms_row(label: str, values: list[float], baseline: list[float] | None = None) -> list[str]:
    row = [label, str(len(values))] + [h.fmt(h.percentile(values, q), 0) for q in (50, 90, 99)] + [
        h.fmt(max(values), 0) if values else "n/a"]
    if baseline is not None:
        base = h.percentile(baseline, 99)
        row.append(f"{h.percentile(values, 99) / base:.2f}x" if values and base else "n/a")
    return row


def _mib(kb: int) -> str:
    return f"{kb / 1024:,.0f}"


def run(*, tasks: int = 10_000, probes: int = 200, mcp_probes: int = 20, interval: float = 0.2, sweeps: int = 20,
        poll_seconds: float = 3600, workers: int = 2, timeout: float = 900) -> h.Report:
    h.migrate_if_needed()
    sizes = sorted({0, tasks // 10, tasks})
    report = h.Report(
        "active_tasks", "10,000 active tasks: step start, sweeper pass, memory, connections",
        f"Up to {tasks:,} active `mcp` tasks waiting on a loopback MCP server's remote tasks (2 h long, polled every "
        f"{poll_seconds:g} s), {SEEDS} through the real path and the rest copies of them, with a qcluster of {workers} "
        f"worker processes running; at {', '.join(f'{s:,}' for s in sizes)} idle tasks: {probes} `sleep` probes "
        f"submitted every {interval:g} s (admission -> first claim), {mcp_probes} short remote probes, "
        f"{sweeps} timed sweeper passes (tasks.sweeper.run_once), the cluster's RSS and the database's sessions.",
    )
    margin = SEEDS + 4 * (probes + mcp_probes + WARM_PROBES) + 100
    max_running = tasks + margin
    scope = h.Scope.create("active", max_running=max_running)
    deadline = time.monotonic() + timeout
    tmp = Path(tempfile.mkdtemp(prefix="longhaul-active-"))
    phases: dict[int, dict[str, Any]] = {}
    grown: dict[int, float] = {}
    sampler: Sampler | None = None
    try:
        state = tmp / "state"
        state.mkdir()
        with McpTaskServer("http", state_dir=state, timeout_s=20) as server:
            servers_file = str(write_servers_file(tmp / "servers.json", server))
            env = {"LONGHAUL_MCP_SERVERS": servers_file, "LONGHAUL_MAX_RUNNING": str(max_running)}
            with h.override(LONGHAUL_MCP_SERVERS=servers_file, LONGHAUL_MAX_RUNNING=max_running), \
                    h.qcluster("active_tasks", workers=workers, **env) as cluster:
                h.wait_until(lambda: GUARD_LINE.search(cluster.output()) is not None, timeout=60, interval=0.2,
                             message="the worker cluster to start")
                sampler = Sampler(cluster)
                sampler.start()
                seed_ids: list[int] = []
                made = 0
                for size in sizes:
                    if time.monotonic() > deadline:
                        report.notes.append(f"--timeout reached before the phase at {size:,} idle tasks.")
                        break
                    if size > made:
                        sampler.phase = "growing"
                        started = time.monotonic()
                        if not seed_ids:
                            seed_ids = submit_seeds(scope, min(SEEDS, size), poll_seconds=poll_seconds)
                            h.wait_until(lambda ids=seed_ids: waiting_on_a_poll(ids) == len(ids),
                                         timeout=max(1.0, min(120.0, deadline - time.monotonic())), interval=0.2,
                                         message="the seed tasks to wait on their next poll")
                            made = len(seed_ids)
                        grow(seed_ids, size - made, state_dir=state, poll_seconds=poll_seconds, start=made)
                        made = size
                        h.vacuum_analyze(*CHURNED)
                        grown[size] = time.monotonic() - started
                        print(f"{size:,} idle tasks made in {grown[size]:.0f} s", flush=True)
                    sampler.phase = str(size)
                    phase = measure_phase(scope, size, probes=probes, mcp_probes=mcp_probes, interval=interval,
                                          sweeps=sweeps, deadline=deadline)
                    phases[size] = phase
                    print(f"{size:,} idle: step start p50 {h.percentile(phase['step_start'], 50):.0f} ms, "
                          f"p99 {h.percentile(phase['step_start'], 99):.0f} ms; sweep p50 "
                          f"{h.percentile(phase['sweeps'], 50):.1f} ms", flush=True)
                sampler.phase = "end"
                time.sleep(sampler.interval * 1.5)
    finally:
        if sampler is not None:
            sampler.stopping.set()
            sampler.join(timeout=10)
        scope.purge()
        h.reconnecting(lambda: h.vacuum_analyze(*CHURNED))
        shutil.rmtree(tmp, ignore_errors=True)

    measured = sorted(phases)
    if not measured:
        report.targets.append(h.Target("the benchmark reached a phase", "none within --timeout", False))
        return report
    baseline = phases[measured[0]]["step_start"] if measured[0] == 0 else None
    report.add("Step start after a task is due (milliseconds)", h.table(
        ["idle tasks", "probes", "p50", "p90", "p99", "max", "p99 / 0 idle"],
        [_ms_row(f"{phases[s]['idle']:,}", phases[s]["step_start"], baseline) for s in measured])
        + "\n\nA `sleep` probe is due when admitted (at submission; next_run_at = AdmissionRecord.admitted_at) and "
          "its step starts when a worker claims it (AdmissionRecord.started_at). \"idle tasks\": the tenant's tasks "
          "waiting on a remote task whose next poll is not due, counted after the probes.")
    rows = []
    for s in measured:
        rows.append(_ms_row(f"{phases[s]['idle']:,}: call's result recorded -> next step committed",
                            phases[s]["remote_step"]))
        rows.append(_ms_row(f"{phases[s]['idle']:,}: call due -> claimed by a gateway job", phases[s]["remote_claim"]))
    report.add("Remote results (reference; milliseconds)", h.table(
        ["idle tasks: interval", "calls", "p50", "p90", "p99", "max"], rows)
        + f"\n\n{mcp_probes} `mcp` probes per phase, their remote tasks {PROBE_REMOTE_SECONDS} s long, polled every "
          f"{PROBE_POLL_MS / 1000:g} s: every tools/call and tasks/get they made. A step's commit includes the step's "
          "own work (a few ms).")
    smallest = next((s for s in measured if s > 0), None)
    rows = []
    for s in measured:
        v = phases[s]["sweeps"]
        ratio = (f"{h.percentile(v, 50) / h.percentile(phases[smallest]['sweeps'], 50):.2f}x"
                 if smallest is not None and s > 0 else "-")
        rows.append([f"{phases[s]['idle']:,}", len(v), h.fmt(h.percentile(v, 50), 1), h.fmt(h.percentile(v, 90), 1),
                     h.fmt(max(v), 1) if v else "n/a", ratio])
    report.add("Sweeper pass: tasks.sweeper.run_once (milliseconds)", h.table(
        ["idle tasks", "passes", "p50", "p90", "max", f"p50 / at {smallest or 0:,}"], rows)
        + "\n\nRun in this process, after the phase's probes ended, while the cluster ran (and its own sweep every "
          "minute). Repairs and kicks it made: " + "; ".join(
            f"{phases[s]['idle']:,}: " + (", ".join(f"{k} {v}" for k, v in sorted(phases[s]["sweep_counts"].items()))
                                          or "none") for s in measured) + ".")
    rows = []
    for name in phases[measured[0]]["parts"]:
        p50 = {s: h.percentile(phases[s]["parts"].get(name, []), 50) for s in measured}
        comparable = smallest is not None and smallest != measured[-1] and p50[smallest] > 0
        rows.append([name, *[h.fmt(p50[s], 2) for s in measured],
                     f"{p50[measured[-1]] / p50[smallest]:.2f}x" if comparable else "-"])
    report.add("Sweeper parts, one by one (p50 of 5, milliseconds)", h.table(
        ["part", *[f"{phases[s]['idle']:,} idle" for s in measured], f"{measured[-1]:,} / {smallest or 0:,}"], rows)
        + "\n\nThe parts of run_once called directly; the liveness rules' queries (liveness.repair runs them all) "
          "timed on their own, read-only.")
    if sampler is not None:
        rows = []
        for s in measured:
            key = str(s)
            per = sampler.rss.get(key, {})
            workers_kb = sorted((kb for pid, kb in per.items() if sampler.roles.get(pid, "worker") == "worker"),
                                reverse=True)
            others = ", ".join(f"{sampler.roles.get(pid, '?')} {_mib(kb)}" for pid, kb in sorted(per.items())
                               if sampler.roles.get(pid, "worker") != "worker")
            rows.append([f"{phases[s]['idle']:,}", ", ".join(_mib(kb) for kb in workers_kb) or "n/a",
                         _mib(sampler.tree_kb.get(key, 0)), _mib(sampler.chat_kb.get(key, 0)), others or "-"])
        peak = sorted((kb for pid, kb in sampler.hwm.items() if sampler.roles.get(pid, "worker") == "worker"),
                      reverse=True)
        report.add("Worker memory (MiB, highest sample)", h.table(
            ["idle tasks", "RSS of each worker process", "task cluster, all its processes (PSS)",
             "chat cluster (PSS)", "RSS of the task cluster's other processes"], rows)
            + f"\n\nSampled every {sampler.interval:g} s ({sampler.samples} samples) from /proc/<pid>/status and "
              "smaps_rollup. RSS counts the pages a forked worker still shares with its parent; PSS divides them among "
              "the sharers, so it sums. Peak RSS (VmHWM) of each worker process over the whole run: "
              f"{', '.join(_mib(kb) for kb in peak) or 'n/a'} MiB. django-q2 recycles a worker after 500 jobs "
              "(LONGHAUL_Q_RECYCLE, django-q2's default), so a long phase lists the workers that replaced the first two.")
        rows = []
        for s in measured:
            got = sampler.sessions.get(str(s), Counter())
            per = sorted(sampler.per_process.get(str(s), Counter()).items())
            rows.append([f"{phases[s]['idle']:,}", got["total"], got["task cluster"],
                         ", ".join(f"{sampler.roles.get(pid, '?')} {n}" for pid, n in per) or "-",
                         got["chat cluster"], got["this process"], got["other"]])
        report.add("Database connections (most at once)", h.table(
            ["idle tasks", "all sessions", "task cluster", "task cluster, per process", "chat cluster",
             "this process", "other"], rows)
            + "\n\n`SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()` every "
              f"{sampler.interval:g} s; each column is its own maximum. \"this process\" counts the benchmark's own "
              "two (its main thread and the sampler's); \"other\": sessions of no process here ("
              + (", ".join(sorted(sampler.other_kinds)) or "none seen") + ").")
        if sampler.errors:
            report.notes.append(f"{len(sampler.errors)} samples failed, e.g. {sampler.errors[0]}")
    report.add("Setup", h.table(["measure", "value"], [
        ["idle tasks asked for", f"{tasks:,} (phases at {', '.join(f'{s:,}' for s in sizes)})"],
        ["idle tasks reached", f"{max(phases[s]['idle'] for s in measured):,}"],
        ["made (seeds through the cluster, copies, VACUUM ANALYZE)",
         ", ".join(f"{s:,} in {t:.0f} s" for s, t in grown.items()) or "-"],
        ["probe statuses", "; ".join(f"{phases[s]['idle']:,}: " + ", ".join(
            f"{k} {v}" for k, v in sorted(phases[s]["statuses"].items())) for s in measured)],
        ["LONGHAUL_MAX_RUNNING and the tenant's max_running", f"{max_running:,}"],
    ]))
    for s in measured:
        report.notes.extend(phases[s]["notes"])
    if measured[-1] != tasks:
        report.notes.append(f"Only {measured[-1]:,} of the {tasks:,} idle tasks asked for were reached.")

    largest = measured[-1]
    p99 = h.percentile(phases[largest]["step_start"], 99)
    others = ", ".join(f"{h.fmt(h.percentile(phases[s]['step_start'], 99), 0)} ms at {phases[s]['idle']:,}"
                       for s in measured if s != largest)
    report.targets.append(h.Target(
        f"step start p99 after a task is due < {STEP_START_TARGET_MS / 1000:g} s with {largest:,} idle tasks",
        f"{h.fmt(p99, 0)} ms" + (f" ({others})" if others else ""), not math.isnan(p99) and p99 < STEP_START_TARGET_MS))
    if smallest is not None and smallest != largest:
        small, large = h.percentile(phases[smallest]["sweeps"], 50), h.percentile(phases[largest]["sweeps"], 50)
        ratio = large / small
        report.targets.append(h.Target(
            f"sweeper pass flat within {FLAT_TARGET}x from {smallest:,} to {largest:,} idle tasks (p50)",
            f"{ratio:.2f}x ({small:.1f} -> {large:.1f} ms)", ratio <= FLAT_TARGET))
    if sampler is not None:
        key = str(largest)
        per = sampler.rss.get(key, {})
        worker_max = max((kb for pid, kb in per.items() if sampler.roles.get(pid, "worker") == "worker"), default=0)
        base = sampler.rss.get(str(measured[0]), {})
        base_max = max((kb for pid, kb in base.items() if sampler.roles.get(pid, "worker") == "worker"), default=0)
        report.targets.append(h.Target(
            f"worker memory with {largest:,} idle tasks (reported, no target)",
            f"{_mib(worker_max)} MiB RSS per worker process at most ({_mib(base_max)} MiB at {measured[0]:,})", None))
        got = sampler.sessions.get(key, Counter())
        report.targets.append(h.Target(
            f"database connections with {largest:,} idle tasks (reported, no target)",
            f"{got['total']} sessions at most ({got['task cluster']} the task cluster's, {got['chat cluster']} the "
            f"chat cluster's, {got['this process']} this benchmark's)", None))
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=10_000, help="idle tasks at the last phase (N/10 before it)")
    parser.add_argument("--probes", type=int, default=200, help="sleep probes per phase")
    parser.add_argument("--mcp-probes", type=int, default=20, help="short remote (mcp) probes per phase")
    parser.add_argument("--interval", type=float, default=0.2, help="seconds between two probe submissions")
    parser.add_argument("--sweeps", type=int, default=20, help="timed sweeper passes per phase")
    parser.add_argument("--poll-seconds", type=float, default=3600,
                        help="the poll interval the idle tasks' remote server asks for")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=900, help="seconds allowed for the whole run")
    args = parser.parse_args()
    if not SEEDS <= args.tasks // 10 or args.tasks > LIMITS["tasks"]:
        parser.error(f"--tasks must be between {SEEDS * 10} and {LIMITS['tasks']:,}")
    for name, limit in LIMITS.items():
        if name == "mcp_probes" and args.mcp_probes == 0:
            continue
        if name != "tasks" and not 0 < getattr(args, name) <= limit:
            parser.error(f"--{name.replace('_', '-')} must be above 0 and at most {limit}")
    report = run(tasks=args.tasks, probes=args.probes, mcp_probes=args.mcp_probes, interval=args.interval,
                 sweeps=args.sweeps, poll_seconds=args.poll_seconds, workers=args.workers, timeout=args.timeout)
    print()
    print(report.markdown())


if __name__ == "__main__":
    main()
