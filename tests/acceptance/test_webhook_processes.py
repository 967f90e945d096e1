"""A real qcluster delivers webhooks; a worker killed mid-delivery loses nothing: the delivery's lease
expires and another worker sends the same message (same webhook-id) again."""

from __future__ import annotations

import os
import signal

import pytest
from django.db import connection

from tests.factories import submit_sleep
from tests.fakes.webhook_receiver import WebhookReceiver
from tests.processes import qcluster, wait_until
from webhooks import endpoints
from webhooks.models import Delivery, DeliveryStatus

pytestmark = [pytest.mark.acceptance, pytest.mark.django_db(transaction=True)]

SETTINGS = {
    "LONGHAUL_ALLOW_PRIVATE_FETCH": "1",  # the receiver is on loopback
    "LONGHAUL_STEP_SLICE_MS": "0",
    "LONGHAUL_LEASE_SECONDS": "2",
    "LONGHAUL_Q_TIMEOUT": "10",
    "LONGHAUL_Q_RETRY": "12",
    # Long enough for the test to kill the worker while its request hangs; short enough to recover soon.
    "LONGHAUL_WEBHOOK_TIMEOUT_S": "8",
    "LONGHAUL_WEBHOOK_LEASE_SECONDS": "9",
}


def fresh_delivery() -> Delivery | None:
    connection.close()  # see other processes' commits with a fresh snapshot
    return Delivery.objects.first()


def test_a_worker_killed_mid_delivery_loses_nothing(acme, alice, log_dir, settings):
    settings.LONGHAUL_ALLOW_PRIVATE_FETCH = True
    with WebhookReceiver() as receiver:
        _, secret = endpoints.register(tenant=acme, actor=alice, owner=alice, url=receiver.url + "/hook",
                                       events=["task.succeeded"])
        receiver.secrets.append(secret)
        receiver.hang()
        with qcluster(log_dir, workers=2, **SETTINGS) as cluster:
            submit_sleep(acme, alice, steps=1)
            wait_until(receiver.arrived.is_set, timeout=60, message="the first delivery attempt to arrive")
            row = fresh_delivery()
            assert row is not None and row.status == DeliveryStatus.CLAIMED
            pid = int(row.lease_owner.rsplit(":", 1)[1])
            assert pid in cluster.descendants(), "the deliverer is one of the cluster's workers"
            os.kill(pid, signal.SIGKILL)
            receiver.release()
            wait_until(lambda: fresh_delivery().status == DeliveryStatus.DELIVERED, timeout=90, interval=0.5,
                       message="another worker to deliver it")
        row = fresh_delivery()
        assert row.attempts == 2
        accepted = receiver.accepted()
        assert accepted, "the second attempt was accepted"
        assert {m.webhook_id for m in receiver.received} == {row.webhook_id}, "one message id on every attempt"
        assert all(m.verified_by == [0] for m in receiver.received)
