"""Backpressure: a full queue answers 429 up front, writes nothing, and is counted and alerted."""

from __future__ import annotations

from datetime import timedelta

import pytest
import time_machine

from tasks import clock, scheduling
from tasks.models import Alert, AuditEntry, IdempotencyRecord, Task, Tenant
from tests.factories import make_task

pytestmark = pytest.mark.django_db
SLEEP = {"kind": "sleep", "name": "nap", "input": {"steps": 2}}


def submit(client, key: str):
    return client.post("/api/tasks", SLEEP, format="json", HTTP_IDEMPOTENCY_KEY=key)


def test_over_the_system_queue_cap_it_answers_429_and_writes_nothing(alice_api, acme, globex, charlie, settings):
    settings.LONGHAUL_MAX_QUEUED = 2
    Tenant.objects.update(max_running=0)
    make_task(globex, charlie)
    assert submit(alice_api, key="a").status_code == 201  # acme's own quota (100) is far away
    response = submit(alice_api, key="b")
    assert response.status_code == 429, response.content
    assert response.json()["code"] == "queue_full"
    assert "system" in response.json()["error"]
    assert int(response["Retry-After"]) > 0
    assert Task.objects.filter(tenant=acme).count() == 1
    assert not IdempotencyRecord.objects.filter(key="b").exists()


def test_a_refusal_is_audited_and_alerts_at_most_once_per_tenant_per_hour(acme, globex, alice):
    start = clock.now()
    with time_machine.travel(start, tick=False) as traveller:
        for _ in range(3):
            scheduling.record_rejection(acme, user_id=alice.pk, reason="the system queue is full", now=clock.now())
            traveller.shift(timedelta(minutes=20))
        scheduling.record_rejection(globex, user_id=None, reason="quota", now=clock.now())
        assert Alert.objects.filter(kind=Alert.Kind.QUOTA_REJECTIONS, tenant=acme).count() == 1
        traveller.shift(timedelta(minutes=1))  # 61 minutes after acme's first alert
        scheduling.record_rejection(acme, user_id=alice.pk, reason="the system queue is full", now=clock.now())
    assert Alert.objects.filter(kind=Alert.Kind.QUOTA_REJECTIONS, tenant=acme).count() == 2
    assert Alert.objects.filter(kind=Alert.Kind.QUOTA_REJECTIONS, tenant=globex).count() == 1
    assert AuditEntry.objects.filter(action=scheduling.REJECTED, tenant=acme).count() == 4
    assert "acme" in Alert.objects.filter(tenant=acme).first().message


def test_a_refused_submission_is_counted_and_alerted(alice_api, acme):
    Tenant.objects.filter(pk=acme.pk).update(max_running=0, max_queued=1)
    assert submit(alice_api, key="a").status_code == 201
    assert submit(alice_api, key="b").status_code == 429
    assert AuditEntry.objects.filter(action=scheduling.REJECTED, tenant=acme).count() == 1
    assert Alert.objects.filter(kind=Alert.Kind.QUOTA_REJECTIONS, tenant=acme).count() == 1
