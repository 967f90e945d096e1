"""The faults the drill injects into real processes: kill -9 of a worker holding something,
SIGTERM drains, a PostgreSQL restart, and kicks that are duplicated or point at nothing due.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from random import Random

from django.db import connection
from django.utils import timezone

from chat.models import Run
from tasks import kicks
from tasks.models import Operation, Task
from tasks.statuses import TERMINAL, NotificationStatus, OperationStatus

RESTART_SECONDS = 60  # pg_ctlcluster restart; it returns once the server accepts connections again


@dataclass(frozen=True)
class Holder:
    """A worker process holding a lease: what it holds and its pid."""

    what: str  # "step", "operation", "chat run", "delivery"
    ident: int
    pid: int


def _pid(owner: str) -> int | None:
    host, _, pid = owner.rpartition(":")
    return int(pid) if host == socket.gethostname() and pid.isdigit() else None


def lease_holders(tenant_id: int, pids: set[int]) -> list[Holder]:
    """Live leases of the tenant's work held by one of `pids`: mid-step, mid-call, mid-run, mid-delivery."""
    now = timezone.now()
    found: list[tuple[str, int, str]] = []
    tasks = Task.objects.filter(tenant_id=tenant_id)
    found += [("step", pk, owner) for pk, owner in
              tasks.exclude(lease_owner="").filter(lease_expires_at__gt=now).values_list("pk", "lease_owner")]
    found += [("delivery", pk, owner) for pk, owner in
              tasks.exclude(notification_lease_owner="").filter(notification_lease_expires_at__gt=now)
              .values_list("pk", "notification_lease_owner")]
    found += [("operation", pk, owner) for pk, owner in
              Operation.objects.filter(task__tenant_id=tenant_id, status=OperationStatus.STARTED,
                                       lease_expires_at__gt=now).exclude(lease_owner="")
              .values_list("pk", "lease_owner")]
    found += [("chat run", pk, owner) for pk, owner in
              Run.objects.filter(tenant_id=tenant_id, status=Run.Status.RUNNING, lease_expires_at__gt=now)
              .exclude(lease_owner="").values_list("pk", "lease_owner")]
    holders = []
    for what, ident, owner in found:
        pid = _pid(owner)
        if pid is not None and pid in pids:
            holders.append(Holder(what, ident, pid))
    return holders


def kill_holder(holders: list[Holder], rng: Random) -> Holder | None:
    """kill -9 one holder: first a kind of work (step, operation, chat run, delivery), then one of them,
    so that the rarer moments are hit as often as steps."""
    if not holders:
        return None
    kind = rng.choice(sorted({h.what for h in holders}))
    victim = rng.choice([h for h in holders if h.what == kind])
    try:
        os.kill(victim.pid, signal.SIGKILL)
    except ProcessLookupError:
        return None
    return victim


# --- PostgreSQL ----------------------------------------------------------------------


@dataclass(frozen=True)
class PostgresControl:
    """A local cluster this process may restart with pg_ctlcluster, or why it may not."""

    version: str = ""
    name: str = ""
    refusal: str = ""

    @classmethod
    def find(cls) -> PostgresControl:
        if os.environ.get("LONGHAUL_DRILL_PG_RESTART") != "1":
            return cls(refusal="LONGHAUL_DRILL_PG_RESTART is not 1 (the server is shared; `make test` sets it)")
        if connection.vendor != "postgresql":
            return cls(refusal=f"the database is {connection.vendor}, not PostgreSQL")
        settings = connection.settings_dict
        host, port = settings.get("HOST") or "", str(settings.get("PORT") or 5432)
        if host not in ("127.0.0.1", "localhost", "::1", "") and not host.startswith("/"):
            return cls(refusal=f"DATABASE_URL points at {host}, not a server on this machine")
        if shutil.which("pg_ctlcluster") is None or shutil.which("pg_lsclusters") is None:
            return cls(refusal="pg_ctlcluster is not installed here")
        if os.geteuid() != 0 and pwd.getpwuid(os.geteuid()).pw_name != "postgres":
            return cls(refusal="only root or postgres may restart the cluster")
        listing = subprocess.run(["pg_lsclusters", "--no-header"], capture_output=True, text=True, timeout=10)
        for line in listing.stdout.splitlines():
            fields = line.split()
            if len(fields) >= 4 and fields[2] == port and fields[3] == "online":
                return cls(version=fields[0], name=fields[1])
        return cls(refusal=f"no online cluster on port {port} in pg_lsclusters")

    @property
    def available(self) -> bool:
        return not self.refusal

    def restart(self) -> float:
        """Restart the server (fast shutdown: every connection is cut); returns how long it took."""
        started = time.monotonic()
        subprocess.run(["pg_ctlcluster", "--skip-systemctl-redirect", self.version, self.name, "restart"],
                       check=True, capture_output=True, timeout=RESTART_SECONDS)
        connection.close()  # this process's connection died with the server
        return time.monotonic() - started


# --- kicks ---------------------------------------------------------------------------


def pointless_kicks(tenant_id: int, rng: Random) -> int:
    """A duplicate pair of kicks for a task (often one with nothing due: queued, waiting for a tool),
    and one kick for something already done: a finished task, a delivered notification, an
    answered chat run, or the operations of nobody. Each must change nothing."""
    tasks = list(Task.objects.filter(tenant_id=tenant_id).values_list("pk", "status", "notification_status"))
    if not tasks:
        return 0
    active = [pk for pk, status, _ in tasks if status not in TERMINAL]
    sent = 0
    if active:
        pk = rng.choice(active)
        kicks.kick("advance", pk)
        kicks.kick("advance", pk)
        sent += 2
    done: list[tuple[str, int]] = [("operations", 0)]
    done += [("advance", pk) for pk, status, _ in tasks if status in TERMINAL]
    done += [("deliver", pk) for pk, _, told in tasks if told == NotificationStatus.DELIVERED]
    done += [("run", pk) for pk in Run.objects.filter(tenant_id=tenant_id, status=Run.Status.SUCCEEDED)
             .values_list("pk", flat=True)[:50]]
    job, ident = rng.choice(done)
    kicks.kick(job, ident)
    return sent + 1
