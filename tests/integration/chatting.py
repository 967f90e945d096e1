"""Helpers to drive chat runs and deliveries in-process, as workers would."""

from __future__ import annotations

from django_q.models import OrmQ
from django_q.signing import SignedPackage

from chat import jobs as chat_jobs
from tasks import jobs


def queued_jobs() -> list[tuple[str, int]]:
    """(function, id) of every kick waiting in the broker table."""
    out = []
    for row in OrmQ.objects.order_by("id"):
        package = SignedPackage.loads(row.payload)
        out.append((package["func"], package["args"][0]))
    return out


def run_queued(*, rounds: int = 20) -> None:
    """Run chat runs and deliveries that are queued, until none are left (steps are not run here)."""
    for _ in range(rounds):
        pending = [(f, i) for f, i in queued_jobs() if f in ("chat.jobs.run_agent", "tasks.jobs.deliver")]
        OrmQ.objects.all().delete()
        if not pending:
            return
        for func, ident in pending:
            if func == "chat.jobs.run_agent":
                chat_jobs.run_agent(ident)
            else:
                jobs.deliver(ident)
