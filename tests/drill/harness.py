"""The drill: real processes, a mixed load, faults on a timeline, then the invariants.

    report = Drill(DrillConfig.short(log_dir), tenant, user).run()
    print(report.summary())
    assert not report.violations

Processes: one daphne (Redis channel layer) and two qcluster clusters of two workers with short
leases. Cluster "a" keeps the offline model provider and corpus; cluster "b" talks to the faulty
loopback model and search fakes (tests/drill/gateways.py). Every job goes to whichever worker
takes it, so any task's calls may meet the faults.

Timeline, seeded (DrillConfig.seed, printed in the summary): kill -9 of workers holding a
lease, a SIGTERM drain of one cluster followed by a replacement, a PostgreSQL restart when the
server can be controlled (faults.PostgresControl), and pointless kicks every `kick_every` seconds.

Quiescence: after the load phase the drill waits for every task to end, every chat run to finish
and every notification to be delivered. The sweeper is a django-q2 schedule that runs at most
once a minute, so while waiting the drill calls `tasks.sweeper.run_once` and
`chat.runs.kick_stale` itself every `sweep_every` seconds, as a stand-in for that schedule; the
summary counts what they kicked (work whose own recovery path did not bring it back in time).
"""

from __future__ import annotations

import logging
import os
import re
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from random import Random
from typing import Any, TypeVar

from django.conf import settings
from django.db import InterfaceError, OperationalError, connection
from django.db.models import Q
from django.utils import timezone

from chat import runs as chat_runs
from chat.models import Run
from tasks import kicks, sweeper
from tasks.gateway import corpus
from tasks.models import Operation, Task
from tasks.statuses import TERMINAL, NotificationStatus, OperationStatus, TaskStatus
from tests.drill import faults, invariants
from tests.drill.gateways import FaultyModel, FaultySite, faulty_cluster_env
from tests.drill.invariants import Violation
from tests.drill.load import Api, Load, LoadPlan, plan, submit
from tests.drill.stream import StreamWatcher, session_cookie
from tests.processes import Process, child_env, daphne

T = TypeVar("T")
REDIS_URL = os.environ.get("LONGHAUL_DRILL_REDIS_URL") or os.environ.get("REDIS_URL") or "redis://127.0.0.1:6379/0"
# Short leases so that a dead worker's work is taken over within seconds; q timeout < retry.
CLUSTER_ENV = {
    "LONGHAUL_LEASE_SECONDS": "2",
    "LONGHAUL_Q_TIMEOUT": "6",
    "LONGHAUL_Q_RETRY": "8",
    "LONGHAUL_OPERATION_LEASE_SECONDS": "5",
    "LONGHAUL_STEP_SLICE_MS": "0",
    "LONGHAUL_DEBUG_DRIVERS": "1",
    # A gateway job must end within the q timeout: its slice plus one operation lease.
    "LONGHAUL_GATEWAY_SLICE_SECONDS": "1",
    # Retries of injected faults come quickly, so that a short drill sees them through.
    "LONGHAUL_RETRY_BASE_SECONDS": "0.3",
    "LONGHAUL_RETRY_CAP_SECONDS": "3",
    "LONGHAUL_NOTIFY_RETRY_BASE_SECONDS": "0.5",
    # The faulty site is on 127.0.0.1, and any cluster may visit a page the faulty search found.
    "LONGHAUL_ALLOW_PRIVATE_FETCH": "1",
}
DRAIN_SECONDS = 40.0
logging.getLogger("httpx2").setLevel(logging.WARNING)  # a line per request of the load drowns the summary
STOP_SECONDS = 15.0


@dataclass
class DrillConfig:
    log_dir: Path
    seed: int
    load_seconds: float  # the load runs and faults are injected for this long
    settle_seconds: float  # then at most this long for everything to end
    load: LoadPlan
    kills: int
    drains: int
    pg_restarts: int
    kick_every: float = 2.0
    sweep_every: float = 4.0
    watch: int = 2  # tasks followed over WebSocket (a sleep and a research task)
    workers: int = 2

    @classmethod
    def short(cls, log_dir: Path, *, seed: int | None = None) -> DrillConfig:
        """About a minute: what `make test` runs."""
        return cls(log_dir=log_dir, seed=_seed(seed), load_seconds=28, settle_seconds=75,
                   load=LoadPlan(sleep_tasks=12, research_tasks=3, chat_flows=2, spread_seconds=18),
                   kills=3, drains=1, pg_restarts=1)

    @classmethod
    def for_minutes(cls, minutes: float, log_dir: Path, *, seed: int | None = None) -> DrillConfig:
        """A long drill: the same mix at the same rate, faults throughout."""
        seconds = max(60.0, minutes * 60)
        scale = seconds / 28
        return cls(log_dir=log_dir, seed=_seed(seed), load_seconds=seconds, settle_seconds=max(120.0, seconds / 4),
                   load=LoadPlan(sleep_tasks=round(12 * scale), research_tasks=round(3 * scale),
                                 chat_flows=max(2, round(2 * scale)), spread_seconds=seconds - 10),
                   kills=max(3, round(3 * scale)), drains=max(1, round(seconds / 90)),
                   pg_restarts=max(1, round(seconds / 180)))


def _seed(seed: int | None) -> int:
    if seed is not None:
        return seed
    raw = os.environ.get("LONGHAUL_DRILL_SEED")
    return int(raw) if raw else Random().randrange(1_000_000)


@dataclass
class DrillReport:
    seed: int
    seconds: float
    tasks: Counter[str]
    faults: Counter[str]
    sweeper_kicks: Counter[str]
    violations: list[Violation]
    notes: list[str] = field(default_factory=list)

    def summary(self) -> str:
        statuses = ", ".join(f"{status} {n}" for status, n in sorted(self.tasks.items()))
        injected = ", ".join(f"{name} {n}" for name, n in sorted(self.faults.items()) if n)
        swept = ", ".join(f"{name} {n}" for name, n in sorted(self.sweeper_kicks.items()) if n) or "none"
        return (f"drill seed={self.seed}: tasks={sum(self.tasks.values())} ({statuses}); "
                f"faults={sum(self.faults.values())} ({injected}); sweeper stand-in kicked: {swept}; "
                f"invariant violations={len(self.violations)}; {self.seconds:.0f}s")

    def describe(self) -> str:
        lines = [self.summary(), *[f"  VIOLATION {v}" for v in self.violations], *[f"  note: {n}" for n in self.notes]]
        return "\n".join(lines)


class Cluster:
    """One qcluster: its main process, and every process below it."""

    def __init__(self, name: str, env: dict[str, str], log_dir: Path, workers: int) -> None:
        self.name = name
        self.env = env
        self.process = Process(name, [sys.executable, "manage.py", "qcluster"],
                               child_env(LONGHAUL_WORKERS=str(workers), **env), log_dir)

    def pids(self) -> set[int]:
        return set(self.process.descendants())

    def alive(self) -> bool:
        return self.process.popen.poll() is None

    def drain(self) -> float:
        """SIGTERM to the main process, as an operator stops a worker; returns how long it took to exit."""
        started = time.monotonic()
        os.kill(self.process.pid, signal.SIGTERM)
        try:
            self.process.popen.wait(DRAIN_SECONDS)
        finally:
            self.process.stop(signal.SIGKILL)  # whatever is left of the group, and the log file
        return time.monotonic() - started

    def stop(self) -> None:
        if self.alive():
            # The main process alone: signalled beside it, workers hang until a SIGKILL (test_stream_processes).
            os.kill(self.process.pid, signal.SIGTERM)
            try:
                self.process.popen.wait(STOP_SECONDS)
            except Exception:
                pass
        self.process.stop(signal.SIGKILL)


class Drill:
    def __init__(self, config: DrillConfig, *, tenant_id: int, user: Any, token: str) -> None:
        self.config = config
        self.tenant_id = tenant_id
        self.user = user
        self.token = token
        self.rng = Random(config.seed)
        self.faults: Counter[str] = Counter()
        self.swept: Counter[str] = Counter()
        self.notes: list[str] = []
        self.clusters: list[Cluster] = []
        self._clusters_lock = threading.Lock()
        self.watchers: list[StreamWatcher] = []
        self.session_keys: list[str] = []
        self.thread_ids: list[str] = []
        self.postgres = faults.PostgresControl.find() if config.pg_restarts else faults.PostgresControl(
            refusal="not asked for")

    # --- the run -----------------------------------------------------------------------

    def run(self) -> DrillReport:
        started = time.monotonic()
        for old in self.config.log_dir.glob("*.log"):  # a previous run's drained clusters would mislead
            old.unlink()
        corpus.ensure_index()  # built once here, not by a worker racing its q timeout
        if not self.postgres.available:
            self.notes.append(f"PostgreSQL restart skipped: {self.postgres.refusal}")
        with ExitStack() as stack:
            model = stack.enter_context(FaultyModel(Random(self.rng.random())))
            site = stack.enter_context(FaultySite(Random(self.rng.random())))
            base = stack.enter_context(daphne(self.config.log_dir, REDIS_URL=REDIS_URL))
            stack.callback(self._stop_clusters)
            offline = {**CLUSTER_ENV, "REDIS_URL": REDIS_URL}
            self._start_cluster("a", offline)
            self._start_cluster("b", {**offline, **faulty_cluster_env(model, site)})
            # Chat runs have a queue of their own; its cluster is not a fault target (the runs' own
            # recovery is tested in tests/integration), so it is outside self.clusters.
            chat = Cluster("chat", {**offline, "Q_CLUSTER_NAME": settings.LONGHAUL_CHAT_QUEUE}, self.config.log_dir,
                           workers=1)
            stack.callback(chat.stop)
            api = Api(base, self.token)
            stack.callback(api.close)
            load = self._prepare(api, base)
            stack.callback(load.stop.set)
            stack.callback(self._stop_watchers)
            load.start()
            self._timeline(load)
            settling = time.monotonic()
            quiet = self._settle(load)
            self.notes.append(f"load phase {settling - load.started:.0f}s, then "
                              f"{'quiescent' if quiet else 'still busy'} after {time.monotonic() - settling:.0f}s")
            now = timezone.now()
            violations = self._db(lambda: invariants.check_all(self.tenant_id, now=now, watchers=self.watchers))
            if not quiet:
                violations.insert(0, Violation("the system quiesces", self._what_is_left(load)))
            violations += [Violation("every request of the load succeeded", error) for error in load.errors]
            self.faults.update({f"{name}": n for name, n in model.faults.items()})
            self.faults.update({f"{name}": n for name, n in site.faults.items()})
            self.faults["ws_reconnects"] = sum(w.connections - 1 for w in self.watchers)
            self.faults["api_retries"] = api.retried
            self._note_load(load, model, site)
        self.notes += log_errors(self.config.log_dir)
        tasks = Counter(self._db(lambda: list(Task.objects.filter(tenant_id=self.tenant_id)
                                              .values_list("status", flat=True))))
        return DrillReport(seed=self.config.seed, seconds=time.monotonic() - started, tasks=tasks,
                           faults=self.faults, sweeper_kicks=self.swept, violations=violations, notes=self.notes)

    def _prepare(self, api: Api, base: str) -> Load:
        """Chat threads, the watched tasks and their watchers, and the plan of the rest."""
        for n in range(max(1, self.config.load.chat_flows)):
            self.thread_ids.append(api.call("POST", "/api/threads", json={"title": f"drill chat {n}"})["id"])
        deadline = time.monotonic() + self.config.load_seconds + self.config.settle_seconds
        cookie, key = session_cookie(self.user)
        self.session_keys.append(key)
        watched = [submit(api, "sleep", {"steps": 10, "step_seconds": 0.6, "side_effect": True}, name="watched sleep"),
                   submit(api, "research", {"question": "how asyncio cancellation works"}, name="watched research")]
        for task in watched[: self.config.watch]:
            watcher = StreamWatcher(base, task["id"], cookie, Random(self.rng.random()), deadline)
            watcher.start()
            self.watchers.append(watcher)
        items = plan(self.config.load, self.rng, threads=self.thread_ids)
        return Load(api, items, self.thread_ids)

    def _timeline(self, load: Load) -> None:
        """Inject the faults at seeded moments of the load phase; pointless kicks all along."""
        span = self.config.load_seconds
        events: list[tuple[float, str]] = []
        for i in range(self.config.kills):
            events.append((span * (i + self.rng.uniform(0.3, 0.9)) / self.config.kills, "kill"))
        for i in range(self.config.drains):
            events.append((span * (i + self.rng.uniform(0.35, 0.55)) / self.config.drains, "drain"))
        if self.postgres.available:
            for i in range(self.config.pg_restarts):
                events.append((span * (i + self.rng.uniform(0.55, 0.75)) / self.config.pg_restarts, "pg_restart"))
        events.sort()
        started = load.started
        next_kick = self.config.kick_every
        drains: list[threading.Thread] = []
        while True:
            elapsed = time.monotonic() - started
            if elapsed >= span:
                break
            if events and events[0][0] <= elapsed:
                _, what = events.pop(0)
                if what == "kill":
                    self._kill()
                elif what == "drain":
                    drains.append(self._drain_in_background())
                else:
                    self._restart_postgres()
                continue
            if elapsed >= next_kick:
                next_kick = elapsed + self.config.kick_every
                self.faults["pointless_kicks"] += self._db(lambda: faults.pointless_kicks(self.tenant_id, self.rng),
                                                           default=0)
                continue
            time.sleep(0.05)
        for thread in drains:
            thread.join(DRAIN_SECONDS + 30)

    def _settle(self, load: Load) -> bool:
        """Wait for the load to finish and the system to quiesce, sweeping as the schedule would."""
        deadline = time.monotonic() + self.config.settle_seconds
        next_sweep = time.monotonic() + self.config.sweep_every
        while time.monotonic() < deadline:
            if load.done() and all(w.end is not None for w in self.watchers) and self._db(self._quiet, default=False):
                return True
            if time.monotonic() >= next_sweep:
                next_sweep = time.monotonic() + self.config.sweep_every
                self._sweep()
            time.sleep(0.3)
        return False

    # --- faults --------------------------------------------------------------------------

    def _all_pids(self) -> set[int]:
        with self._clusters_lock:
            clusters = list(self.clusters)
        pids: set[int] = set()
        for cluster in clusters:
            pids |= cluster.pids()
        return pids

    def _kill(self) -> None:
        """kill -9 a worker that holds something; wait a little for one if none does right now."""
        deadline = time.monotonic() + 3
        pids, pids_at = self._all_pids(), time.monotonic()
        while time.monotonic() < deadline:
            if time.monotonic() - pids_at > 1:  # a respawned worker has a new pid
                pids, pids_at = self._all_pids(), time.monotonic()
            holders = self._db(lambda: faults.lease_holders(self.tenant_id, pids), default=[])
            victim = faults.kill_holder(holders, self.rng)
            if victim is not None:
                self.faults["kill9"] += 1
                self.notes.append(f"kill -9 {victim.pid} holding {victim.what} {victim.ident}")
                return
            time.sleep(0.05)
        self.notes.append("kill -9 skipped: no worker held anything for 3 s")

    def _drain_in_background(self) -> threading.Thread:
        """SIGTERM the cluster a step is running in (any, if none), then start its replacement."""
        with self._clusters_lock:
            clusters = list(self.clusters)
        pids = {cluster.name: cluster.pids() for cluster in clusters}
        holders = self._db(lambda: faults.lease_holders(self.tenant_id, set().union(*pids.values())), default=[])
        busy = [c for c in clusters if any(h.pid in pids[c.name] and h.what == "step" for h in holders)]
        cluster = self.rng.choice(busy or clusters)

        def drain() -> None:
            try:
                seconds = cluster.drain()
            except Exception as exc:  # it died some other way: replace it all the same
                self.notes.append(f"SIGTERM drain of cluster {cluster.name} failed: {type(exc).__name__}: {exc}")
            else:
                self.faults["sigterm_drain"] += 1
                self.notes.append(f"SIGTERM drained cluster {cluster.name} in {seconds:.1f}s")
            with self._clusters_lock:
                self.clusters.remove(cluster)
                generation = sum(1 for c in self.clusters if c.name.startswith(cluster.name[0])) + 2
            self._start_cluster(f"{cluster.name[0]}{generation}", cluster.env)

        thread = threading.Thread(target=drain, name="drill-drain", daemon=True)
        thread.start()
        return thread

    def _restart_postgres(self) -> None:
        try:
            seconds = self.postgres.restart()
        except Exception as exc:
            self.notes.append(f"PostgreSQL restart failed: {exc}")
            return
        self.faults["pg_restart"] += 1
        self.notes.append(f"PostgreSQL restarted in {seconds:.1f}s")

    # --- helpers -------------------------------------------------------------------------

    def _start_cluster(self, name: str, env: dict[str, str]) -> None:
        cluster = Cluster(name, env, self.config.log_dir, self.config.workers)
        with self._clusters_lock:
            self.clusters.append(cluster)

    def _stop_clusters(self) -> None:
        with self._clusters_lock:
            clusters = list(self.clusters)
        threads = [threading.Thread(target=c.stop, daemon=True) for c in clusters]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(STOP_SECONDS + 15)

    def _stop_watchers(self) -> None:
        for watcher in self.watchers:
            watcher.stop.set()
        for watcher in self.watchers:
            watcher.join(5)

    def _sweep(self) -> None:
        """The sweeper's schedule, run from here; each kick it sends is noted with the row it is for,
        as it was: work that waited for the sweeper is work whose own recovery path did not fire."""
        def sweep() -> None:
            now = timezone.now()
            send = kicks.kick

            def noting(job: str, ident: int, *, at: Any = None) -> None:
                why = describe_kick(job, ident, now=now, tenant_id=self.tenant_id)
                if why:
                    self.swept[f"{job}_kicks"] += 1
                    self.notes.append(f"sweeper stand-in kicked {job} {ident}: {why}")
                send(job, ident, at=at)

            kicks.kick = noting  # the sweeper and chat.runs call it through the module
            try:
                sweeper.run_once(now=now)
                chat_runs.kick_stale(now)
            finally:
                kicks.kick = send

        self._db(sweep)

    def _quiet(self) -> bool:
        tasks = Task.objects.filter(tenant_id=self.tenant_id)
        if tasks.exclude(status__in=[*TERMINAL, TaskStatus.PARTIAL]).exists():
            return False
        if Run.objects.filter(tenant_id=self.tenant_id, status__in=[Run.Status.PENDING, Run.Status.RUNNING]).exists():
            return False
        return not tasks.filter(thread__isnull=False, notification_status__in=[
            NotificationStatus.PENDING, NotificationStatus.CLAIMED, NotificationStatus.DISPATCHED,
            NotificationStatus.RETRY]).exists()

    def _what_is_left(self, load: Load) -> str:
        def left() -> str:
            tasks = Task.objects.filter(tenant_id=self.tenant_id)
            active = Counter(tasks.exclude(status__in=[*TERMINAL, TaskStatus.PARTIAL]).values_list("status", flat=True))
            runs = Run.objects.filter(tenant_id=self.tenant_id, status__in=[Run.Status.PENDING, Run.Status.RUNNING])
            telling = Counter(tasks.filter(thread__isnull=False).values_list("notification_status", flat=True))
            return (f"after {self.config.settle_seconds:.0f}s: load done {load.done()}, active tasks "
                    f"{dict(active)}, active runs {runs.count()}, notifications {dict(telling)}, watchers ended "
                    f"{[w.end is not None for w in self.watchers]}")

        return self._db(left, default="(the database did not answer)")

    def _note_load(self, load: Load, model: FaultyModel, site: FaultySite) -> None:
        self.notes.append(f"load: {len(load.submitted) + len(self.watchers)} tasks submitted over the API, "
                          f"{len(load.chat_runs)} chat runs, {len(self.thread_ids)} threads; model requests "
                          f"{dict(model.purposes)}, site requests {dict(site.requests)}")
        scripted = sum(1 for task in load.submitted if task.get("input", {}).get("fail_at_step"))
        self.faults["sleep_transient_failures"] += scripted
        for watcher in self.watchers:
            self.notes.append(f"watcher {watcher.task_public_id[:8]}: {len(watcher.received)} events over "
                              f"{watcher.connections} connections, {watcher.drops} drops, server closes "
                              f"{Counter(watcher.server_closes)}, end {watcher.end}")

    def _db(self, query: Callable[[], T], *, default: Any = None, seconds: float = 20.0) -> T:
        """Run a query from this process, reconnecting while PostgreSQL restarts."""
        deadline = time.monotonic() + seconds
        while True:
            try:
                return query()
            except (OperationalError, InterfaceError) as exc:
                connection.close()
                if time.monotonic() > deadline:
                    self.notes.append(f"database unavailable to the drill: {exc}")
                    if default is not None:
                        return default
                    raise
                time.sleep(0.5)


def create_drill_user(tenant: Any, username: str) -> tuple[Any, str]:
    """A member of `tenant` with an API token."""
    from django.contrib.auth.models import User
    from rest_framework.authtoken.models import Token

    from tasks.models import Membership

    user = User.objects.create_user(username=username, password=None)
    Membership.objects.create(user=user, tenant=tenant, role=Membership.Role.MEMBER)
    token, _ = Token.objects.get_or_create(user=user)
    return user, token.key



# What a process logs at ERROR or above that the drill's own faults explain.
EXPECTED_LOG_ERRORS = (
    re.compile(r"reincarnated worker .* after death"),  # kill -9
)
_LOG_ERROR = re.compile(r"^\S+ \S+ (?P<level>ERROR|CRITICAL) (?P<logger>\S+) (?P<message>.*)$")


def log_errors(log_dir: Path) -> list[str]:
    """ERROR and CRITICAL lines of the processes' logs, counted by process and message, as notes.
    Not invariants: they are for the reader, who decides whether they are news."""
    counts: Counter[tuple[str, str]] = Counter()
    for path in sorted(log_dir.glob("*.log")):
        for line in path.read_text(errors="replace").splitlines():
            found = _LOG_ERROR.match(line)
            if found is None or any(p.search(found["message"]) for p in EXPECTED_LOG_ERRORS):
                continue
            message = re.sub(r"\b[0-9a-f]{32}\b|\b[0-9a-f-]{36}\b|\(\S+-\S+-\S+-\S+-\S+\)", "…",
                             found["message"])[:160]
            counts[(path.stem, f"{found['level']} {found['logger']} {message}")] += 1
    return [f"log {name}: {n}x {message}" for (name, message), n in sorted(counts.items())]


def _ago(when: Any, now: Any) -> str:
    if when is None:
        return "none"
    seconds = (when - now).total_seconds()
    return f"in {seconds:.1f}s" if seconds >= 0 else f"{-seconds:.1f}s ago"


def describe_kick(job: str, ident: int, *, now: Any, tenant_id: int) -> str:
    """The row a sweeper kick is for, as it is now ("" if it is not the drill tenant's)."""
    if job == "run":
        run = Run.objects.filter(pk=ident, tenant_id=tenant_id).first()
        if run is None:
            return ""
        return (f"{run.kind} run {run.status}, lease {run.lease_owner or 'free'} expiring "
                f"{_ago(run.lease_expires_at, now)}, attempts {run.attempts}, created {_ago(run.created_at, now)}")
    if job == "operations":
        # The sweeper kicks operations with no grace period: only those waiting past one are news.
        ops = list(Operation.objects.filter(task__tenant_id=tenant_id, args__isnull=False).filter(
            Q(status=OperationStatus.PENDING, created_at__lt=now - sweeper.KICK_GRACE)
            | Q(status=OperationStatus.STARTED, lease_expires_at__lt=now)))
        return "; ".join(f"{op.key} {op.kind} {op.name} {op.status} lease {op.lease_owner or 'free'} expiring "
                         f"{_ago(op.lease_expires_at, now)}, attempts {op.attempts}" for op in ops[:5])
    task = Task.objects.filter(pk=ident, tenant_id=tenant_id).first()
    if task is None:
        return ""
    if job == "deliver":
        return (f"notification {task.notification_status} v{task.dispatch_version}/{task.event_version}, lease "
                f"{task.notification_lease_owner or 'free'} expiring {_ago(task.notification_lease_expires_at, now)}, "
                f"due {_ago(task.next_notification_at, now)}, attempts {task.notification_attempt_count}")
    events = list(task.events.order_by("-seq").values_list("kind", flat=True)[:3])
    return (f"{task.kind} task {task.status} at step {task.current_step}, lease {task.lease_owner or 'free'} expiring "
            f"{_ago(task.lease_expires_at, now)}, due {_ago(task.next_run_at, now)}, attempts {task.attempts}, "
            f"last events {events[::-1]}")
