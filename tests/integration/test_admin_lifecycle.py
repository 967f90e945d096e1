"""The admin's part of the data lifecycle (DESIGN §14): a tenant's retention overrides, and the two-step
erasure of a tenant's data."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.urls import reverse

from chat.models import Message, Thread
from project import retention as rules
from tasks import clock
from tasks.models import AuditEntry, Task, TaskEvent, Tenant
from tasks.statuses import TaskStatus
from tests.factories import make_task
from tests.integration.test_admin import make_operator, signed_in

S = TaskStatus
pytestmark = pytest.mark.django_db
QUOTAS = {"max_running": 4, "max_queued": 100, "weight": 1}


def edit_tenant(client, tenant: Tenant, **retention: int | str):
    form = {**QUOTAS, **{f"retention_{name}": value for name, value in retention.items()}, "_save": "Save"}
    return client.post(reverse("admin:tasks_tenant_change", args=[tenant.pk]), form)


def test_retention_overrides_are_saved_from_the_tenant_form_and_audited(root_client, root, acme):
    response = edit_tenant(root_client, acme, events=14, checkpoints=0, messages="")
    assert response.status_code == 302, response.content.decode()[:2000]
    acme.refresh_from_db()
    assert acme.retention == {"events": 14, "checkpoints": 0}, "an empty field follows the system's days"
    entry = AuditEntry.objects.get(action="tenant.retention")
    assert entry.actor == root and entry.details == {"before": {}, "after": {"events": 14, "checkpoints": 0}}

    form = root_client.get(reverse("admin:tasks_tenant_change", args=[acme.pk])).content.decode()
    assert 'name="retention_events" value="14"' in form


@pytest.mark.parametrize(("retention", "field", "words"), [
    ({"events": rules.MAX_DAYS + 1}, "retention_events", "events must be a whole number of days"),
    ({"events": -1}, "retention_events", "Ensure this value is greater than or equal to 0"),
    ({"audit": 5}, "retention_audit", "audit must be 0 or at least"),
])
def test_a_retention_out_of_range_is_refused_naming_the_field(root_client, acme, retention, field, words):
    response = edit_tenant(root_client, acme, **retention)
    assert response.status_code == 200
    errors = response.context["adminform"].form.errors
    assert field in errors and words in str(errors[field]), errors
    acme.refresh_from_db()
    assert acme.retention == {} and not AuditEntry.objects.filter(action="tenant.retention").exists()


def test_erasing_a_tenants_data_takes_two_steps_and_leaves_the_tenant_and_an_audit(root_client, root, acme, alice,
                                                                                    globex, charlie):
    thread = Thread.objects.create(tenant=acme, owner=alice, title="acme's")
    Message.objects.create(thread=thread, role="user", content="acme secret", created_at=clock.now())
    ended = make_task(acme, alice, status=S.SUCCEEDED, thread=thread)
    TaskEvent.objects.create(task=ended, tenant=acme, seq=1, kind="queued", at=clock.now())
    queued = make_task(acme, alice, status=S.QUEUED)
    held = make_task(acme, alice, status=S.RUNNING, lease_owner="worker:1",
                     lease_expires_at=clock.now() + timedelta(minutes=5))
    theirs = make_task(globex, charlie, status=S.SUCCEEDED)
    changelist = reverse("admin:tasks_tenant_changelist")
    step = {"action": "erase_data", "_selected_action": [acme.pk]}

    first = root_client.post(changelist, step)
    assert first.status_code == 200 and "Type <code>acme</code> to confirm" in first.content.decode()
    assert Task.objects.filter(tenant=acme).count() == 3, "the first step erases nothing"

    wrong = root_client.post(changelist, {**step, "confirm_slug": "globex"}, follow=True)
    assert "Nothing was done" in wrong.content.decode()
    assert Task.objects.filter(tenant=acme).count() == 3 and Thread.objects.filter(pk=thread.pk).exists()

    done = root_client.post(changelist, {**step, "confirm_slug": "acme"}, follow=True)
    assert "Erased the data of acme" in done.content.decode()
    assert not Thread.objects.filter(tenant=acme).exists() and "acme secret" not in [m.content for m in Message.objects.all()]
    assert list(Task.objects.filter(tenant=acme)) == [held], "the running task goes once it stops"
    assert not Task.objects.filter(pk__in=[ended.pk, queued.pk]).exists()
    held.refresh_from_db()
    assert held.cancel_requested_at is not None and held.delete_requested_at is not None
    assert Tenant.objects.filter(pk=acme.pk).exists() and Task.objects.filter(pk=theirs.pk).exists()
    entry = AuditEntry.objects.get(action="tenant.erase")
    assert entry.actor == root and entry.tenant == acme
    assert entry.details["deleted"]["task"] == 2 and entry.details["deleted"]["thread"] == 1
    assert entry.details["deleted"]["taskevent"] >= 1 and entry.details["tasks_pending"] == 1
    assert "acme secret" not in str(entry.details)


def test_only_a_superuser_may_erase_a_tenants_data(acme, alice, globex):
    operator = make_operator("otto", acme)
    task = make_task(acme, alice, status=S.SUCCEEDED)
    response = signed_in(operator).post(reverse("admin:tasks_tenant_changelist"),
                                        {"action": "erase_data", "_selected_action": [acme.pk],
                                         "confirm_slug": "acme"}, follow=True)
    assert "Only a superuser may do this" in response.content.decode()
    assert Task.objects.filter(pk=task.pk).exists() and not AuditEntry.objects.filter(action="tenant.erase")
