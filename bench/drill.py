"""The long fault drill: the drill of tests/acceptance/test_drill.py for N minutes.

    DATABASE_URL=postgres://longhaul:longhaul@127.0.0.1:5432/longhaul_bench \\
        .venv/bin/python bench/drill.py --minutes 10 [--seed 123]

Migrates DATABASE_URL, creates its own tenant, user, token and session there, starts daphne
and two qclusters against it (tests/drill/harness.py), runs the mixed load with faults all
along (kill -9 about twice a minute, a SIGTERM drain every 90 s, a PostgreSQL restart every
3 minutes when LONGHAUL_DRILL_PG_RESTART=1 and the server is local), waits for quiescence,
checks the invariants, prints the one-line summary and the notes, and deletes its rows.
Exits 1 when an invariant was violated. Needs Redis (REDIS_URL or LONGHAUL_DRILL_REDIS_URL,
default redis://127.0.0.1:6379/0). Loopback only; bounded by --minutes plus the settle time.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_MINUTES = 240


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=5.0, help=f"load phase, 1 to {MAX_MINUTES} (default 5)")
    parser.add_argument("--seed", type=int, default=None, help="replay a drill (default: random, printed)")
    parser.add_argument("--keep-rows", action="store_true", help="leave the drill's rows for inspection")
    args = parser.parse_args()
    if not 1 <= args.minutes <= MAX_MINUTES:
        parser.error(f"--minutes must be between 1 and {MAX_MINUTES}")
    return args


def main() -> int:
    args = parse_args()
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
    os.environ.setdefault("LONGHAUL_DEBUG_DRIVERS", "1")
    import django

    django.setup()  # loads daphne, which installs Twisted's reactor: the drill's WebSocket client fits
    from django.core.management import call_command
    from django.db import connection

    from tasks.models import Tenant
    from tests.drill.harness import Drill, DrillConfig, create_drill_user

    if connection.vendor != "postgresql":
        sys.exit("set DATABASE_URL=postgres://...: the drill runs against PostgreSQL")
    call_command("migrate", interactive=False, verbosity=0)
    suffix = uuid.uuid4().hex[:8]
    log_dir = ROOT / "var" / "bench-logs" / f"drill-{suffix}"
    log_dir.mkdir(parents=True, exist_ok=True)
    tenant = Tenant.objects.create(slug=f"drill-{suffix}", name=f"Drill {suffix}", max_running=8, max_queued=5000)
    user, token = create_drill_user(tenant, f"drill-{suffix}")
    started = time.time()
    drill = Drill(DrillConfig.for_minutes(args.minutes, log_dir, seed=args.seed), tenant_id=tenant.pk, user=user,
                  token=token)
    try:
        report = drill.run()
        print(report.describe())
        print(f"logs: {log_dir}")
    finally:
        if args.keep_rows:
            print(f"rows kept: tenant {tenant.slug}")
        else:
            removed = clean_up(tenant, user, drill.session_keys, since=started)
            print(f"cleaned up: {removed}")
    return 1 if report.violations else 0


def clean_up(tenant, user, session_keys: list[str], *, since: float) -> str:
    """Delete every row the drill made: its tenant's tasks, threads and audit, its user and session,
    leftover kicks for its tasks and runs, and the failures django-q2 recorded for them."""
    from datetime import datetime, timezone

    from django.contrib.sessions.models import Session
    from django.db import connection, transaction
    from django_q.models import OrmQ
    from django_q.models import Task as QTask
    from django_q.signing import BadSignature, SignedPackage

    from chat.models import Run, Thread
    from tasks.kicks import JOBS
    from tasks.models import AuditEntry, Task

    connection.close()  # the drill may have restarted PostgreSQL under this connection
    task_ids = set(Task.objects.filter(tenant=tenant).values_list("pk", flat=True))
    run_ids = set(Run.objects.filter(tenant=tenant).values_list("pk", flat=True))

    def ours(func: str, args: tuple) -> bool:
        ids = run_ids if func == JOBS["run"] else task_ids
        return func in JOBS.values() and bool(args) and args[0] in ids and args[0] != 0

    kicks = []
    for row in OrmQ.objects.all().only("pk", "payload").iterator():
        try:
            package = SignedPackage.loads(row.payload)
        except (BadSignature, TypeError, ValueError):
            continue
        if ours(package.get("func", ""), tuple(package.get("args") or ())):
            kicks.append(row.pk)
    failures = [row.pk for row in QTask.objects.filter(started__gte=datetime.fromtimestamp(since, timezone.utc))
                .only("pk", "func", "args").iterator() if ours(row.func, tuple(row.args or ()))]
    with transaction.atomic():
        counts = {
            "kicks": OrmQ.objects.filter(pk__in=kicks).delete()[0],
            "job records": QTask.objects.filter(pk__in=failures).delete()[0],
            "tasks": Task.objects.filter(tenant=tenant).delete()[0],
            "threads": Thread.objects.filter(tenant=tenant).delete()[0],
            "audit": AuditEntry.objects.filter(tenant=tenant).delete()[0],
            "sessions": Session.objects.filter(session_key__in=session_keys).delete()[0],
        }
        user.delete()
        tenant.delete()
    return ", ".join(f"{name} {n}" for name, n in counts.items()) + " rows, the user and the tenant"


if __name__ == "__main__":
    sys.exit(main())
