"""The functions django-q2 executes for webhooks. Each re-reads the truth from the database;
the message that started it is only a hint."""

from __future__ import annotations

import logging

from asgiref.sync import async_to_sync
from django.conf import settings

from tasks import clock, drain, kicks, leases
from webhooks import outbox, sender, signing

log = logging.getLogger(__name__)


def deliver(delivery_id: int) -> str:
    """Claim the delivery if it is due and send it once; record what the receiver said."""
    with drain.job():
        if drain.draining.is_set():
            kicks.kick(outbox.JOB, delivery_id)  # hand the hint on to a worker that is not stopping
            return "handed_on"
        return send(delivery_id)


def send(delivery_id: int) -> str:
    """One attempt: claim, sign with the endpoint's current secrets, POST (no transaction open), record."""
    owner = leases.worker_identity()
    now = clock.now()
    claimed = outbox.claim(delivery_id, owner=owner, now=now)
    if claimed is None:
        return "nothing"
    headers = signing.headers(message_id=claimed.webhook_id, at=now, body=claimed.body,
                              signing_secrets=claimed.signing_secrets)
    try:
        sent = async_to_sync(sender.post)(claimed.url, body=claimed.body, headers=headers)
    except sender.SendFailed as exc:
        log.info("webhook delivery %s attempt %s failed", delivery_id, claimed.attempt)
        return outbox.fail(claimed, owner, str(exc), status_code=exc.status_code, permanent=exc.permanent,
                           now=clock.now())
    except Exception as exc:  # a surprise while sending counts as a failed attempt; it never crash-loops
        log.warning("webhook delivery %s attempt %s raised", delivery_id, claimed.attempt, exc_info=True)
        return outbox.fail(claimed, owner, f"{type(exc).__name__}: {exc}", status_code=None, permanent=False,
                           now=clock.now())
    return "delivered" if outbox.delivered(claimed, owner, status_code=sent.status_code, now=clock.now()) else "lost"


def sweep() -> int:
    """The safety net (a django-q2 schedule, once a minute): re-kick lost kicks and dead deliverers' rows."""
    kicked = outbox.kick_due(clock.now(), limit=settings.LONGHAUL_SWEEP_BATCH)
    if kicked:
        log.info("webhook sweep: %s deliveries kicked", kicked)
    return kicked
