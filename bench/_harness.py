"""What the benchmarks share: Django setup, the machine line, rows of their own and their
removal, real processes, percentiles and the Markdown report.

Every benchmark creates its own tenant and users (slug `bench-<name>-<random>`) in the
database DATABASE_URL names, and removes every row it made, broker rows included, when
it ends, also after a failure. Use a database of its own for benchmarks:

    DATABASE_URL=postgres://longhaul:longhaul@127.0.0.1:5432/longhaul_bench .venv/bin/python bench/run_all.py
"""

from __future__ import annotations

import os
import platform
import signal
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
LOG_ROOT = ROOT / "var" / "bench-logs"


def _development_key() -> str:
    """The key `make run` generated under var/ (so earlier broker rows still verify), or a new one."""
    path = Path(os.environ.get("LONGHAUL_VAR_DIR", ROOT / "var")) / "secret_key"
    if path.exists():
        return path.read_text().strip()
    import secrets

    return secrets.token_urlsafe(50)


def _development_master_keys() -> str:
    """The master keys `make run` generated under var/ (so data keys it wrapped still open), or a new one."""
    from project import master_keys

    var_dir = Path(os.environ.get("LONGHAUL_VAR_DIR", ROOT / "var"))
    master_keys.load("", debug=True, var_dir=var_dir)  # generated and kept there if it is not yet
    return (var_dir / "master_keys").read_text().strip()


def _unwind(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def setup() -> None:
    """Django for a benchmark process; debug drivers on (the `sleep` kind), PostgreSQL required."""
    # Stopped by SIGTERM (`timeout`, say), a benchmark unwinds as it does for Ctrl-C: its `with` blocks stop the
    # clusters and servers they started. Killed outright, it left a cluster running that loaded the next runs.
    signal.signal(signal.SIGTERM, _unwind)
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
    # Production mode (DEBUG off: no query log, no static autorefresh) with the debug `sleep` kind.
    # Child processes inherit this environment; they must share the key that signs broker messages.
    os.environ.setdefault("DEBUG", "0")
    os.environ.setdefault("LONGHAUL_DEBUG_DRIVERS", "1")
    # Benchmarks submit as fast as one user can: the request throttles would measure themselves.
    for throttle in ("SUBMIT", "ANSWER", "MESSAGE", "THREAD"):
        for per in ("USER", "TENANT"):
            os.environ.setdefault(f"LONGHAUL_THROTTLE_{throttle}_{per}", "off")
    if not os.environ.get("SECRET_KEY"):
        os.environ["SECRET_KEY"] = _development_key()
    if not os.environ.get("LONGHAUL_MASTER_KEYS"):
        os.environ["LONGHAUL_MASTER_KEYS"] = _development_master_keys()
    import django
    from django.apps import apps

    if not apps.ready:
        django.setup()
    import logging

    logging.getLogger("django-q").setLevel(logging.WARNING)  # django-q2 logs every enqueue at INFO
    logging.getLogger("httpx2").setLevel(logging.WARNING)  # and httpx2 every request
    from django.db import connection

    if connection.vendor != "postgresql":
        sys.exit("the benchmarks measure the production mode: set DATABASE_URL=postgres://... "
                 "(a database of their own, e.g. .../longhaul_bench)")
    _create_database_if_missing(connection.settings_dict)


def _create_database_if_missing(s: dict[str, Any]) -> None:
    """CREATE DATABASE for a benchmark database that does not exist yet (the role needs CREATEDB)."""
    import psycopg

    params = dict(host=s["HOST"] or "127.0.0.1", port=s["PORT"] or 5432, user=s["USER"], password=s["PASSWORD"])
    try:
        psycopg.connect(dbname=s["NAME"], **params).close()
        return
    except psycopg.OperationalError as exc:
        if "does not exist" not in str(exc):
            raise
    with psycopg.connect(dbname="postgres", autocommit=True, **params) as admin:
        admin.execute(f'CREATE DATABASE "{s["NAME"]}"')
    print(f"created database {s['NAME']}", flush=True)


setup()

from django.conf import settings  # noqa: E402
from django.contrib.auth.models import User  # noqa: E402
from django.core.management import call_command  # noqa: E402
from django.db import connection, transaction  # noqa: E402
from django.db.migrations.executor import MigrationExecutor  # noqa: E402

from tasks.models import Membership, Tenant  # noqa: E402
from tests import processes  # noqa: E402


def migrate_if_needed() -> None:
    executor = MigrationExecutor(connection)
    if executor.migration_plan(executor.loader.graph.leaf_nodes()):
        print(f"migrating {connection.settings_dict['NAME']} first", flush=True)
        call_command("migrate", verbosity=0)


# --- the machine -------------------------------------------------------------------


def machine() -> dict[str, str]:
    """What the figures were measured on; printed with every report."""
    def version() -> str:
        with connection.cursor() as cursor:
            cursor.execute("SHOW server_version")
            return cursor.fetchone()[0]

    pg = reconnecting(version)
    load = os.getloadavg()
    return {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cores": str(os.cpu_count()),
        "usable cores": str(len(os.sched_getaffinity(0))),
        "load average": f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}",
        "python": platform.python_version(),
        "postgresql": pg.split()[0],
        "database": str(connection.settings_dict["NAME"]),
        "channel layer": "Redis" if settings.REDIS_URL else "in-memory",
    }


def other_sessions() -> int:
    """Connections to this database other than this process's own."""
    def read() -> int:
        with connection.cursor() as cursor:
            cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                           "AND pid <> pg_backend_pid()")
            return cursor.fetchone()[0]

    return reconnecting(read)


def postmaster_started() -> str:
    def read() -> str:
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_postmaster_start_time()")
            return str(cursor.fetchone()[0])

    return reconnecting(read)


def wal_position() -> int:
    """Bytes of write-ahead log the server has generated so far, for all its databases (so a stretch of work counts
    whatever else ran meanwhile, and the full-page images a checkpoint inside it brings): what the stretch wrote
    is the difference, a measure of the writes themselves, steadier than their time on a shared machine."""
    def read() -> int:
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_current_wal_insert_lsn() - '0/0'::pg_lsn")
            return int(cursor.fetchone()[0])

    return reconnecting(read)


def vacuum_analyze(*models: type) -> None:
    """VACUUM (ANALYZE) of `models`' tables, or of the whole database when none is named: what autovacuum
    would have done between two bursts of work. This machine's PostgreSQL runs with autovacuum off (a CI
    setting, `autovacuum_setting()`): without it each round would inherit the dead rows of the rounds
    before and the planner would keep the statistics of an empty table."""
    with connection.cursor() as cursor:
        if not models:
            cursor.execute("VACUUM (ANALYZE)")
        for model in models:
            cursor.execute(f"VACUUM (ANALYZE) {connection.ops.quote_name(model._meta.db_table)}")


def autovacuum_setting() -> str:
    """The server's autovacuum setting, 'on' or 'off'."""
    with connection.cursor() as cursor:
        cursor.execute("SHOW autovacuum")
        return cursor.fetchone()[0]


REFERENCE_LOOP_ITERATIONS = 1_000_000


def reference_loop_ms(repeats: int = 5) -> float:
    """How fast this machine's core runs Python now: the least of `repeats` timings of one fixed loop, in
    milliseconds. The same code's figures move with it (a shared machine's neighbours, a slower host), so each
    report gives it at its start and its end: figures from two runs compare only as far as these do."""
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        total = 0
        for i in range(REFERENCE_LOOP_ITERATIONS):
            total += i * i
        best = min(best, time.perf_counter() - started)
    return best * 1000


def machine_line() -> str:
    m = machine()
    return (f"{m['date']}; {m['cores']} cores ({m['usable cores']} usable); load {m['load average']}; "
            f"Python {m['python']}; PostgreSQL {m['postgresql']} (database {m['database']}); "
            f"channel layer {m['channel layer']}")


# --- numbers -----------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), linear between closest ranks; nan for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def median(values: Iterable[float]) -> float:
    values = list(values)
    return statistics.median(values) if values else float("nan")


def fmt(value: float, digits: int = 1) -> str:
    if value != value:  # nan
        return "n/a"
    return f"{value:,.{digits}f}"


# --- the report --------------------------------------------------------------------


@dataclass
class Target:
    """One target of DESIGN §13 (or the issue), with what was measured against it. met=None: reference only."""

    goal: str
    measured: str
    met: bool | None

    @property
    def verdict(self) -> str:
        return {True: "met", False: "NOT met", None: "reference"}[self.met]


@dataclass
class Report:
    name: str  # the script, e.g. "throughput"
    title: str
    what: str  # one line: what was measured, how
    machine: str = field(default_factory=machine_line)
    sections: list[tuple[str, str]] = field(default_factory=list)  # (heading, Markdown body)
    targets: list[Target] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    database_started: str = field(default_factory=lambda: postmaster_started())
    reference_at_start: float = field(default_factory=reference_loop_ms)
    reference_at_end: float | None = None  # taken when the report is first written out, as its run ends

    def __post_init__(self) -> None:
        others = other_sessions()
        if others:
            self.notes.append(f"{others} other session(s) were connected to this database when the run began; "
                              "if they run workers, they share the broker table with this benchmark.")

    def add(self, heading: str, body: str) -> None:
        self.sections.append((heading, body))

    def markdown(self, *, level: int = 2) -> str:
        if postmaster_started() != self.database_started:
            self.notes.insert(0, "**PostgreSQL restarted during this run** (a fault drill elsewhere on this "
                                 "machine?): the figures are not reliable; run it again.")
            self.database_started = postmaster_started()
        h = "#" * level
        if self.reference_at_end is None:
            self.reference_at_end = reference_loop_ms()
        speed = (f"A reference Python loop ({REFERENCE_LOOP_ITERATIONS:,} iterations, bench/_harness.py) took "
                 f"{self.reference_at_start:.0f} ms at the start and {self.reference_at_end:.0f} ms at the end: "
                 "the fewer, the faster the machine ran.")
        out = [f"{h} {self.title}", "", f"Measured {self.machine}. {speed}", "", self.what, ""]
        for heading, body in self.sections:
            out += [f"{h}# {heading}", "", body.rstrip(), ""]
        if self.targets:
            out += [f"{h}# Targets", "", table(["target", "measured", "verdict"],
                                               [[t.goal, t.measured, t.verdict] for t in self.targets]), ""]
        if self.notes:
            out += [f"{h}# Notes", ""] + [f"- {n}" for n in self.notes] + [""]
        return "\n".join(out)

    def summary(self) -> str:
        """One line for BENCHMARKS.md's overview: what was measured, each target and its verdict."""
        judged = [t for t in self.targets if t.met is not None]
        if not judged:
            return f"**{self.name}** ({self.title}): no target; see below."
        verdict = "all targets met" if all(t.met for t in judged) else "NOT all targets met"
        detail = "; ".join(f"{t.goal}: {t.measured} ({t.verdict})" for t in judged)
        return f"**{self.name}** ({self.title}): {verdict}. {detail}."


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A Markdown table; numbers right-aligned."""
    rows = [[str(c) for c in row] for row in rows]
    align = ["---:" if rows and all(_numeric(r[i]) for r in rows) else "---" for i in range(len(headers))]
    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join(align) + " |"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _numeric(text: str) -> bool:
    cleaned = text.replace(",", "").replace("%", "").replace("x", "").replace("n/a", "0").strip()
    try:
        float(cleaned)
    except ValueError:
        return False
    return True


# --- rows of our own ---------------------------------------------------------------


@dataclass
class Scope:
    """A tenant and users made for one benchmark run; `purge()` removes every row under them."""

    tenant: Tenant
    user: User
    extra_users: list[User] = field(default_factory=list)

    @classmethod
    def create(cls, name: str, *, max_running: int = 1000, max_queued: int = 1_000_000) -> Scope:
        suffix = uuid.uuid4().hex[:8]
        tenant = Tenant.objects.create(slug=f"bench-{name}-{suffix}", name=f"benchmark {name}",
                                       max_running=max_running, max_queued=max_queued)
        user = User.objects.create_user(username=f"bench-{name}-{suffix}")
        Membership.objects.create(user=user, tenant=tenant)
        return cls(tenant, user)

    def add_user(self, label: str) -> User:
        user = User.objects.create_user(username=f"{self.user.username}-{label}")
        Membership.objects.create(user=user, tenant=self.tenant)
        self.extra_users.append(user)
        return user

    def purge(self) -> None:
        users = [self.user.pk, *(u.pk for u in self.extra_users)]
        reconnecting(lambda: purge_tenant(self.tenant.pk, users))


def reconnecting(fn: Callable[[], Any], *, attempts: int = 6) -> Any:
    """Run `fn`, reconnecting if the database went away meanwhile (fault drills restart it on this machine)."""
    from django.db import InterfaceError, OperationalError

    for attempt in range(attempts):
        try:
            return fn()
        except (OperationalError, InterfaceError):
            if attempt == attempts - 1:
                raise
            connection.close()
            time.sleep(2 * (attempt + 1))


def purge_leftovers() -> list[str]:
    """Remove the tenants (and all under them) of benchmark runs that were killed before cleaning up."""
    gone = []
    for tenant in Tenant.objects.filter(slug__startswith="bench-"):
        users = list(Membership.objects.filter(tenant=tenant, user__username__startswith="bench-")
                     .values_list("user_id", flat=True))
        reconnecting(lambda t=tenant, u=users: purge_tenant(t.pk, u))
        gone.append(tenant.slug)
    return gone


def _t(model: Any) -> str:
    return connection.ops.quote_name(model._meta.db_table)


def purge_tenant(tenant_id: int, user_ids: list[int]) -> None:
    """Delete a benchmark tenant and everything under it with plain DELETEs (fast at a million rows),
    then the broker rows (kicks) that name its tasks or runs."""
    from rest_framework.authtoken.models import Token

    from chat.models import Message, Proposal, Run, Thread, ThreadItem
    from tasks.models import (
        AdmissionRecord,
        Alert,
        AuditEntry,
        Checkpoint,
        IdempotencyRecord,
        Operation,
        RetentionMark,
        SleepEffect,
        Task,
        TaskEvent,
        TenantKey,
    )
    from webhooks.models import Delivery, Endpoint

    task_ids = _ids(f"SELECT id FROM {_t(Task)} WHERE tenant_id = %s", [tenant_id])
    run_ids = _ids(f"SELECT id FROM {_t(Run)} WHERE tenant_id = %s", [tenant_id])
    mine = f"(SELECT id FROM {_t(Task)} WHERE tenant_id = %s)"
    statements = [
        (f"DELETE FROM {_t(ThreadItem)} WHERE thread_id IN (SELECT id FROM {_t(Thread)} WHERE tenant_id = %s)",
         [tenant_id]),
        (f"DELETE FROM {_t(Message)} WHERE thread_id IN (SELECT id FROM {_t(Thread)} WHERE tenant_id = %s)",
         [tenant_id]),
        (f"DELETE FROM {_t(Proposal)} WHERE tenant_id = %s", [tenant_id]),
        (f"DELETE FROM {_t(Run)} WHERE tenant_id = %s", [tenant_id]),
        (f"DELETE FROM {_t(Delivery)} WHERE tenant_id = %s", [tenant_id]),
        (f"DELETE FROM {_t(Endpoint)} WHERE tenant_id = %s", [tenant_id]),
        (f"DELETE FROM {_t(AdmissionRecord)} WHERE tenant_id = %s", [tenant_id]),
        (f"DELETE FROM {_t(TaskEvent)} WHERE tenant_id = %s", [tenant_id]),
        (f"DELETE FROM {_t(Checkpoint)} WHERE task_id IN {mine}", [tenant_id]),
        (f"DELETE FROM {_t(Operation)} WHERE task_id IN {mine}", [tenant_id]),
        (f"DELETE FROM {_t(SleepEffect)} WHERE task_id IN {mine}", [tenant_id]),
        (f"DELETE FROM {_t(IdempotencyRecord)} WHERE tenant_id = %s", [tenant_id]),
        (f"DELETE FROM {_t(Alert)} WHERE tenant_id = %s OR task_id IN {mine}", [tenant_id, tenant_id]),
        (f"DELETE FROM {_t(AuditEntry)} WHERE tenant_id = %s", [tenant_id]),
        (f"DELETE FROM {_t(Task)} WHERE tenant_id = %s", [tenant_id]),
        (f"DELETE FROM {_t(Thread)} WHERE tenant_id = %s", [tenant_id]),
        (f"DELETE FROM {_t(Membership)} WHERE tenant_id = %s", [tenant_id]),
        (f"DELETE FROM {_t(TenantKey)} WHERE tenant_id = %s", [tenant_id]),
        (f"DELETE FROM {_t(RetentionMark)} WHERE tenant_id = %s", [tenant_id]),
        (f"DELETE FROM {_t(Tenant)} WHERE id = %s", [tenant_id]),
    ]
    with transaction.atomic(), connection.cursor() as cursor:
        for sql, params in statements:
            cursor.execute(sql, params)
        if user_ids:
            Token.objects.filter(user_id__in=user_ids).delete()
            User.objects.filter(pk__in=user_ids).delete()
    purge_kicks(set(task_ids), set(run_ids))


def _ids(sql: str, params: list[Any]) -> list[int]:
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return [row[0] for row in cursor.fetchall()]


GENERIC_JOBS = ("tasks.jobs.sweep", "chat.jobs.sweep")


def broker_rows() -> Iterator[tuple[int, Any, Any]]:
    """(pk, func, first argument) of each broker row this process can read. Kicks are signed pickles, so
    they are read one by one; a row signed with another key is not ours to judge, and is left out."""
    from django_q.models import OrmQ
    from django_q.signing import SignedPackage

    for pk, payload in OrmQ.objects.values_list("pk", "payload").iterator(chunk_size=2000):
        try:
            package = SignedPackage.loads(payload)
        except Exception:
            continue
        args = package.get("args") or ()
        yield pk, package.get("func"), args[0] if args else None


def purge_kicks(task_ids: set[int], run_ids: set[int], *, funcs: Sequence[str] = (),
                task_arg_zero: bool = False) -> int:
    """Delete the broker rows that name our tasks or runs (or run one of `funcs`)."""
    from django_q.models import OrmQ

    doomed = []
    for pk, func, arg in broker_rows():
        if func in funcs:
            doomed.append(pk)
        elif func == "chat.jobs.run_agent":
            if arg in run_ids:
                doomed.append(pk)
        elif isinstance(func, str) and func.startswith("tasks.jobs.") and (
                arg in task_ids or (task_arg_zero and arg == 0)):
            doomed.append(pk)
    for start in range(0, len(doomed), 5000):
        OrmQ.objects.filter(pk__in=doomed[start:start + 5000]).delete()
    return len(doomed)


def broker_backlog() -> int:
    """Broker rows visible now (not delayed, not taken)."""
    from django.utils import timezone as djtz
    from django_q.models import OrmQ

    return OrmQ.objects.filter(lock__lte=djtz.now()).count()


# --- processes ---------------------------------------------------------------------


def socket_owners(server_port: int, client_ports: set[int], pids: list[int]) -> dict[int, int]:
    """client port -> pid, for loopback connections to `server_port` owned by one of `pids`."""
    inode_port: dict[str, int] = {}
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        parts = line.split()
        local, remote, inode = parts[1], parts[2], parts[9]
        lport, rport = int(local.split(":")[1], 16), int(remote.split(":")[1], 16)
        if rport == server_port and lport in client_ports:
            inode_port[f"socket:[{inode}]"] = lport
    owners: dict[int, int] = {}
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target in inode_port:
                owners[inode_port[target]] = pid
    return owners


def log_dir(name: str) -> Path:
    path = LOG_ROOT / name
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextmanager
def qcluster(name: str, *, workers: int, command: Sequence[str] = ("worker",), chat: bool = True,
             **env: str) -> Iterator[processes.Process]:
    """A real `manage.py worker` against this database (tests/processes.py), stopped with SIGTERM on exit.

    Afterwards the broker rows it left that name no task (a sweep it had taken when it stopped,
    the sweeper's gateway kick) are removed too, with the results it saved of its scheduled
    sweeps: the next cluster's schedule makes new ones.
    """
    started = datetime.now(timezone.utc)
    try:
        with processes.qcluster(log_dir(name), workers=workers, command=command, chat=chat, **env) as cluster:
            yield cluster
    finally:
        reconnecting(lambda: purge_kicks(set(), set(), funcs=GENERIC_JOBS, task_arg_zero=True))
        reconnecting(lambda: _forget_schedule_results(started))


def _forget_schedule_results(since: datetime) -> None:
    """The results django-q2 saved of the sweeps this cluster ran on its schedule."""
    from django_q.models import Task as QueuedTask

    QueuedTask.objects.filter(func__in=GENERIC_JOBS, started__gte=since).delete()


def daphne(name: str, **env: str):
    return processes.daphne(log_dir(name), **env)


def wait_until(predicate: Callable[[], bool], *, timeout: float, interval: float = 0.05,
               message: str = "condition") -> float:
    """Poll a condition another process makes true; returns the time.time() it was seen true."""
    from django.db import InterfaceError, OperationalError

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if predicate():
                return time.time()
        except (OperationalError, InterfaceError):  # the database restarted under us; keep looking
            connection.close()
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout:g} s waiting for {message}")


def fresh_snapshot() -> None:
    """Outside a transaction each query already sees other processes' commits; this just drops
    a connection that a long wait may have left idle."""
    connection.close_if_unusable_or_obsolete()


def override(**values: Any):
    """Settings for this process (admission runs in whichever process submits)."""
    from django.test.utils import override_settings

    return override_settings(**values)


def epoch(dt: datetime | None) -> float:
    return dt.timestamp() if dt is not None else float("nan")


__all__ = [
    "ROOT", "Report", "Scope", "Target", "broker_backlog", "broker_rows", "daphne", "epoch", "fmt", "log_dir", "machine",
    "machine_line", "median", "migrate_if_needed", "override", "percentile", "purge_kicks", "purge_tenant",
    "qcluster", "settings", "table", "wait_until",
]
