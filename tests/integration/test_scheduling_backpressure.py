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


def refuse(tenant, user_id) -> None:
    scheduling.record_rejection(tenant, user_id=user_id, reason="the system queue is full", rule="system_queue_full",
                                now=clock.now())


def test_a_refusal_is_audited_and_alerts_at_most_once_per_tenant_per_hour(acme, globex, alice):
    start = clock.now()
    with time_machine.travel(start, tick=False) as traveller:
        for _ in range(3):
            refuse(acme, alice.pk)
            traveller.shift(timedelta(minutes=20))
        scheduling.record_rejection(globex, user_id=None, reason="quota", rule="tenant_queue_full", now=clock.now())
        assert Alert.objects.filter(kind=Alert.Kind.QUOTA_REJECTIONS, tenant=acme).count() == 1
        traveller.shift(timedelta(minutes=1))  # 61 minutes after acme's first alert
        refuse(acme, alice.pk)
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


# --- shedding by priority ---------------------------------------------------------------------------


def submit_at(client, key: str, priority: int):
    return client.post("/api/tasks", {**SLEEP, "priority": priority}, format="json", HTTP_IDEMPOTENCY_KEY=key)


def test_near_its_cap_a_tenants_queue_refuses_priorities_below_its_median_first(alice_api, acme, alice):
    Tenant.objects.filter(pk=acme.pk).update(max_running=0, max_queued=10)  # shedding from 8 queued (80%)
    for priority in (0, 0, 5, 5, 5, 5, 5):
        make_task(acme, alice, priority=priority)
    assert submit_at(alice_api, "below-threshold", -10).status_code == 201  # 7 queued: everything goes

    refused = submit_at(alice_api, "low", 0)  # 8 queued: the median is 5
    assert refused.status_code == 429, refused.content
    assert refused.json()["code"] == "queue_full"
    assert "priority 5 or higher" in refused.json()["error"]
    assert int(refused["Retry-After"]) > 0
    assert not IdempotencyRecord.objects.filter(key="low").exists()
    [entry] = AuditEntry.objects.filter(action=scheduling.REJECTED)
    assert entry.details["rule"] == "shed_low_priority"

    assert submit_at(alice_api, "median", 5).status_code == 201
    assert submit_at(alice_api, "high", 9).status_code == 201
    at_cap = submit_at(alice_api, "highest", 10)  # 10 queued: the cap refuses every priority
    assert at_cap.status_code == 429
    assert AuditEntry.objects.filter(action=scheduling.REJECTED).latest("at").details["rule"] == "tenant_queue_full"
    assert Task.objects.filter(tenant=acme).count() == 10


def test_another_tenants_priorities_never_shed_this_tenants_work(alice_api, acme, globex, charlie, settings):
    """Shedding looks at the tenant's own queue: the system's would let one tenant's high priorities refuse
    another's work, and tell it how loaded the others are."""
    settings.LONGHAUL_MAX_QUEUED = 10
    settings.LONGHAUL_SHED_THRESHOLD = 0.5
    Tenant.objects.update(max_running=0)
    for _ in range(8):
        make_task(globex, charlie, priority=10)
    assert submit_at(alice_api, "low", -5).status_code == 201  # 80% of the system queue, all priority 10
    assert submit_at(alice_api, "lower", -10).status_code == 201  # the tenth place
    full = submit_at(alice_api, "no-room", 10)
    assert full.status_code == 429
    assert full.json()["error"] == "the system queue is full", "no figure about the other tenants"


def test_a_task_queued_only_to_cancel_counts_in_no_queue(alice_api, acme, alice):
    Tenant.objects.filter(pk=acme.pk).update(max_running=0, max_queued=2)
    make_task(acme, alice, waiting_reason="cancel", cancel_requested_at=clock.now())
    make_task(acme, alice, waiting_reason="cancel", cancel_requested_at=clock.now())
    assert submit_at(alice_api, "after-two-cancels", 0).status_code == 201


def test_a_task_queued_only_to_cancel_counts_in_no_queue_of_the_system_either(alice_api, acme, globex, charlie,
                                                                              settings):
    settings.LONGHAUL_MAX_QUEUED = 2
    Tenant.objects.update(max_running=0)
    make_task(globex, charlie, waiting_reason="cancel", cancel_requested_at=clock.now())
    make_task(globex, charlie, waiting_reason="cancel", cancel_requested_at=clock.now())
    assert submit(alice_api, key="after-their-cancels").status_code == 201
    make_task(globex, charlie)
    assert submit(alice_api, key="now-full").status_code == 429, "two queued to run: the system's queue is full"


def test_the_median_of_a_queue_is_its_lower_middle_priority(acme, alice):
    queue = Task.objects.filter(tenant=acme, status="queued")
    assert scheduling.median_priority(queue) is None
    for priority in (-2, 7, 7, 1):
        make_task(acme, alice, priority=priority)
    assert scheduling.median_priority(queue) == 1
    make_task(acme, alice, priority=7)
    assert scheduling.median_priority(queue) == 7
