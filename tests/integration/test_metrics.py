"""GET /metrics: the runtime's figures, read from the database, for staff or the scrape token only."""

from __future__ import annotations

from datetime import timedelta

import pytest
import time_machine
from django.contrib.auth.models import User
from django.db import transaction
from django.test import Client
from prometheus_client.parser import text_string_to_metric_families

from tasks import clock, pools, scheduling
from tasks.events import NewEvent, append
from tasks.models import Membership, Operation, Task, Tenant
from tasks.statuses import NotificationStatus, OperationStatus, TaskStatus
from tests.conftest import make_user
from tests.factories import make_task, submit_sleep

S = TaskStatus
pytestmark = pytest.mark.django_db
TOKEN = "scrape-token-7f3a"


@pytest.fixture(autouse=True)
def _token(settings):
    settings.LONGHAUL_METRICS_TOKEN = TOKEN


def scrape(client: Client | None = None, **headers: str):
    return (client or Client()).get("/metrics", **headers)


def samples(response) -> dict[tuple[str, frozenset], float]:
    """(sample name, labels) -> value, from a Prometheus text exposition."""
    assert response.status_code == 200, response.content
    text = response.content.decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(found: dict, metric: str, /, **labels: str) -> float:
    return found[(metric, frozenset(labels.items()))]


def bearer(token: str) -> dict[str, str]:
    return {"HTTP_AUTHORIZATION": f"Bearer {token}"}


def test_anonymous_scrapes_are_refused():
    response = scrape()
    assert response.status_code == 401
    assert response["WWW-Authenticate"].startswith("Bearer")
    assert b"longhaul_" not in response.content


def test_a_wrong_token_is_refused():
    assert scrape(**bearer("scrape-token-7f3b")).status_code == 401
    assert scrape(HTTP_AUTHORIZATION=f"Token {TOKEN}").status_code == 401


def test_without_a_configured_token_no_bearer_gets_in(settings):
    settings.LONGHAUL_METRICS_TOKEN = ""
    assert scrape(**bearer("")).status_code == 401
    assert scrape(HTTP_AUTHORIZATION="Bearer ").status_code == 401


def test_a_signed_in_user_who_is_not_staff_is_refused(alice):
    client = Client()
    client.force_login(alice)
    assert scrape(client).status_code == 403


def test_staff_and_the_scrape_token_get_the_metrics(acme):
    staff = User.objects.create_user("operator", is_staff=True)
    client = Client()
    client.force_login(staff)
    assert scrape(client).status_code == 200
    response = scrape(**bearer(TOKEN))
    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/plain")
    assert Client().post("/metrics", **bearer(TOKEN)).status_code == 405


def tenants_in(found: dict) -> set[str]:
    return {dict(labels)["tenant"] for _name, labels in found if "tenant" in dict(labels)}


def test_staff_scoped_to_a_tenant_see_only_that_tenants_series(acme, alice, globex, charlie):
    make_task(acme, alice)
    make_task(globex, charlie, status=S.PAUSED)
    scoped = make_user("acme-operator", acme, role=Membership.Role.ADMIN)
    scoped.is_staff = True
    scoped.save()
    Membership.objects.create(user=scoped, tenant=globex)  # a plain member there: not its operator
    client = Client()
    client.force_login(scoped)
    found = samples(scrape(client))
    assert tenants_in(found) == {"acme"}
    assert value(found, "longhaul_tasks", tenant="acme", status="queued") == 1
    assert value(found, "longhaul_system_max_running") >= 1  # system-wide figures name no tenant
    assert b"globex" not in scrape(client).content

    # Staff who administer no tenant see no tenant's series; superusers and the scrape token see them all.
    unscoped = User.objects.create_user("floater", is_staff=True)
    client.force_login(unscoped)
    assert tenants_in(samples(scrape(client))) == set()
    root = User.objects.create_superuser("root")
    client.force_login(root)
    assert tenants_in(samples(scrape(client))) == {"acme", "globex"}
    assert tenants_in(samples(scrape(**bearer(TOKEN)))) == {"acme", "globex"}


def test_it_exposes_queues_slots_and_why_tasks_wait(acme, alice, globex, charlie, settings):
    settings.LONGHAUL_MAX_RUNNING = 1
    settings.LONGHAUL_METRICS_LONG_WAIT_SECONDS = 300
    make_task(acme, alice, status=S.RUNNING)
    make_task(acme, alice, created_at=clock.now() - timedelta(minutes=10))
    make_task(globex, charlie)
    make_task(globex, charlie, status=S.PAUSED)
    make_task(globex, charlie, status=S.SUCCEEDED)
    found = samples(scrape(**bearer(TOKEN)))
    assert value(found, "longhaul_tasks", tenant="acme", status="running") == 1
    assert value(found, "longhaul_tasks", tenant="acme", status="queued") == 1
    assert value(found, "longhaul_tasks", tenant="globex", status="paused") == 1
    assert ("longhaul_tasks", frozenset({"tenant": "globex", "status": "succeeded"}.items())) not in found
    assert value(found, "longhaul_queue_waiting_long", tenant="acme") == 1
    assert value(found, "longhaul_queue_waiting_long", tenant="globex") == 0
    assert value(found, "longhaul_queue_oldest_wait_seconds", tenant="acme") >= 600
    assert value(found, "longhaul_queue_delay_reason", tenant="globex", reason="system_cap") == 1
    assert value(found, "longhaul_system_running") == 1
    assert value(found, "longhaul_system_max_running") == 1
    assert value(found, "longhaul_tenant_max_running", tenant="acme") == 4


def test_it_exposes_admission_waits_per_tenant(acme, alice):
    Tenant.objects.filter(pk=acme.pk).update(max_running=0)
    start = clock.now()
    with time_machine.travel(start, tick=False) as traveller:
        task = submit_sleep(acme, alice)
        traveller.shift(timedelta(seconds=4))
        Tenant.objects.filter(pk=acme.pk).update(max_running=1)
        with transaction.atomic():
            assert scheduling.admit(now=clock.now()) == [task.pk]
        found = samples(scrape(**bearer(TOKEN)))
    assert value(found, "longhaul_admission_wait_seconds_bucket", tenant="acme", le="2.5") == 0
    assert value(found, "longhaul_admission_wait_seconds_bucket", tenant="acme", le="5.0") == 1
    assert value(found, "longhaul_admission_wait_seconds_gsum", tenant="acme") == pytest.approx(4.0)


def test_it_exposes_takeovers_retries_dead_letters_and_refusals(acme, alice, globex, charlie):
    now = clock.now()
    task = make_task(acme, alice, status=S.RUNNING)
    with transaction.atomic():
        append(task, [NewEvent("recovered", {"step": 0}),
                      NewEvent("retry_scheduled", {"error_class": "rate_limited"}),
                      NewEvent("retry_scheduled", {"error_class": "rate_limited"}),
                      NewEvent("retry_scheduled", {"error_class": "timeout"})], status=S.RUNNING, at=now)
    make_task(acme, alice, status=S.RUNNING, lease_owner="dead:1", lease_expires_at=now - timedelta(seconds=5))
    make_task(globex, charlie, status=S.SUCCEEDED, notification_status=NotificationStatus.DEAD_LETTER)
    scheduling.record_rejection(acme, user_id=alice.pk, reason="full", rule="tenant_queue_full", now=now)
    found = samples(scrape(**bearer(TOKEN)))
    assert value(found, "longhaul_lease_takeovers_recent", tenant="acme") == 1
    assert value(found, "longhaul_leases_expired", tenant="acme") == 1
    assert value(found, "longhaul_retries_recent", tenant="acme", error_class="rate_limited") == 2
    assert value(found, "longhaul_retries_recent", tenant="acme", error_class="timeout") == 1
    assert value(found, "longhaul_notification_dead_letters", tenant="globex") == 1
    assert value(found, "longhaul_queue_rejections_recent", tenant="acme", rule="tenant_queue_full") == 1


def test_it_counts_liveness_repairs_by_rule(acme, alice):
    from tasks import sweeper

    make_task(acme, alice, status=S.QUEUED)  # staged without its admission: the sweeper repairs it
    make_task(acme, alice, status=S.RUNNING, next_run_at=None)  # claimable, never due
    sweeper.run_once(now=clock.now())
    found = samples(scrape(**bearer(TOKEN)))
    assert value(found, "longhaul_liveness_repairs_total", rule="admission_missed") == 1
    assert value(found, "longhaul_liveness_repairs_total", rule="task_not_due") == 1


def test_it_exposes_pool_saturation_and_call_latency(acme, alice, settings):
    settings.LONGHAUL_MODEL_CONCURRENCY = 4
    now = clock.now()
    waiting = make_task(acme, alice, status=S.RUNNING, next_run_at=None, waiting_reason="model")

    def call(n: int, **fields) -> Operation:
        return Operation.objects.create(task=waiting, key=f"{waiting.pk}:0:r{n}", step=0, n=n, kind="model",
                                        name="chat", args={"n": n}, args_digest=str(n), fencing_token=0,
                                        created_at=now, **fields)

    call(0, status=OperationStatus.STARTED, lease_owner="gw:1", lease_expires_at=now + timedelta(minutes=1))
    call(1, status=OperationStatus.PENDING)
    call(2, status=OperationStatus.SUCCEEDED, usage={"duration_ms": 1500, "started_after_ms": 30,
                                                     "recorded_after_ms": 700}, finished_at=now)
    call(3, status=OperationStatus.FAILED, usage={"duration_ms": 40, "started_after_ms": 300,
                                                  "recorded_after_ms": 20}, finished_at=now)
    found = samples(scrape(**bearer(TOKEN)))
    model = pools.key_of("model", "chat", None)  # the configured model's pool
    assert value(found, "longhaul_pool_size", kind="model", pool=model) == 4
    assert value(found, "longhaul_pool_in_flight", kind="model", pool=model) == 1
    assert value(found, "longhaul_pool_saturation", kind="model", pool=model) == 0.25
    assert value(found, "longhaul_pool_pending", kind="model", pool=model) == 1
    assert value(found, "longhaul_pool_in_flight", kind="tool", pool="tool:search") == 0
    assert value(found, "longhaul_operation_duration_seconds_bucket", pool=model, name="chat", le="0.05") == 1
    assert value(found, "longhaul_operation_duration_seconds_bucket", pool=model, name="chat", le="2.5") == 2
    assert value(found, "longhaul_operation_duration_seconds_gsum", pool=model,
                 name="chat") == pytest.approx(1.54)
    # The gateway job's own waits beside the calls' remote work.
    assert value(found, "longhaul_gateway_wait_seconds_bucket", pool=model, part="before_start", le="0.05") == 1
    assert value(found, "longhaul_gateway_wait_seconds_bucket", pool=model, part="before_start", le="0.5") == 2
    assert value(found, "longhaul_gateway_wait_seconds_bucket", pool=model, part="before_record", le="0.05") == 1
    assert value(found, "longhaul_gateway_wait_seconds_gsum", pool=model,
                 part="before_record") == pytest.approx(0.72)


def test_a_scrape_takes_a_bounded_number_of_queries(acme, alice, globex, charlie, django_assert_max_num_queries):
    for tenant, user in ((acme, alice), (globex, charlie)):
        for _ in range(20):
            make_task(tenant, user)
    with django_assert_max_num_queries(25):
        samples(scrape(**bearer(TOKEN)))
    assert Task.objects.count() == 40
