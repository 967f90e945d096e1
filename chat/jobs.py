"""Chat jobs django-q2 executes."""

from __future__ import annotations

import logging

from chat import agent, runs
from tasks import clock, drain, leases

log = logging.getLogger(__name__)


def run_agent(run_id: int) -> None:
    """Claim the run and answer it: one assistant message, stored with the run's end."""
    with drain.job():
        owner = leases.worker_identity()
        now = clock.now()
        run = runs.claim(run_id, owner=owner, now=now)
        if run is None:
            runs.watch_held(run_id, now=now)
            return
        try:
            reply = agent.respond(run)
        except Exception as exc:  # one bad turn must not crash-loop the worker
            log.exception("run %s failed", run_id)
            runs.fail(run, owner=owner, error=f"{type(exc).__name__}: {exc}", now=clock.now())
            return
        runs.complete(run, owner=owner, reply=reply.text, data=reply.data, now=clock.now())


def sweep() -> int:
    """The chat safety net (a django-q2 schedule): re-kick runs whose kick or worker was lost."""
    return runs.kick_stale(clock.now())
