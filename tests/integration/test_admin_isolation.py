"""Tenant walls in the admin: a globex operator sees and acts on globex rows only, everywhere."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import User
from django.test import Client
from django.urls import reverse
from rest_framework.authtoken.models import Token

from tasks import actions
from tasks.errors import InvalidInput
from tasks.models import Alert, AuditEntry, Membership, Task, TaskEvent, Tenant
from tasks.statuses import NotificationStatus, TaskStatus
from tests.factories import make_task
from tests.integration.test_admin import Scene, act, changelist, listed, make_operator, said, signed_in, stage

S = TaskStatus
pytestmark = pytest.mark.django_db

# changelist name -> the scene's row of that model
MODELS = {
    "tasks_task": "task",
    "tasks_taskevent": "event",
    "tasks_checkpoint": "checkpoint",
    "tasks_operation": "operation",
    "tasks_auditentry": "audit",
    "tasks_alert": "alert",
    "chat_thread": "thread",
    "chat_run": "run",
    "chat_message": "message",
}


@pytest.fixture
def scenes(acme, alice, globex, charlie) -> dict[str, Scene]:
    return {"acme": stage(acme, alice), "globex": stage(globex, charlie)}


@pytest.fixture
def olga(globex) -> User:
    """globex's operator: staff, a globex admin member, with the operator permissions."""
    return make_operator("olga", globex)


@pytest.fixture
def olga_client(olga) -> Client:
    return signed_in(olga)


def tenant_rows(scene: Scene, model: str) -> set[int]:
    if model == "tasks_taskevent":  # a scene's task has more than one event
        return set(TaskEvent.objects.filter(task=scene.task).values_list("pk", flat=True))
    return {getattr(scene, MODELS[model]).pk}


@pytest.mark.parametrize("model", MODELS)
def test_an_operator_sees_only_their_tenants_rows_in_every_list(olga_client, scenes, model):
    rows = listed(changelist(olga_client, model))
    assert {row.pk for row in rows} == tenant_rows(scenes["globex"], model)


def test_an_operator_sees_only_their_tenant_with_its_counts(olga_client, scenes, globex):
    assert [(t.slug, t.failed_count) for t in listed(changelist(olga_client, "tasks_tenant"))] == [("globex", 1)]


def test_an_operator_cannot_filter_their_way_into_another_tenant(olga_client, scenes, acme):
    rows = listed(changelist(olga_client, "tasks_task", {"tenant__id__exact": acme.pk}))
    assert scenes["acme"].task.pk not in {task.pk for task in rows}


def test_the_tenant_filter_offers_only_the_operators_tenants(olga, scenes, globex):
    initech = Tenant.objects.create(slug="initech", name="Initech")
    Membership.objects.create(user=olga, tenant=initech, role=Membership.Role.ADMIN)
    response = changelist(signed_in(olga), "tasks_task")
    tenant_filter = next(f for f in response.context["cl"].filter_specs if getattr(f, "field_path", "") == "tenant")
    assert tenant_filter.lookup_choices == [(globex.pk, "globex"), (initech.pk, "initech")]


@pytest.mark.parametrize("model", MODELS)
def test_another_tenants_object_is_not_shown_on_its_change_page(olga_client, scenes, model):
    theirs = getattr(scenes["acme"], MODELS[model])
    response = olga_client.get(reverse(f"admin:{model}_change", args=[theirs.pk]))
    assert response.status_code == 302 and response["Location"] == reverse("admin:index")
    page = olga_client.get(response["Location"]).content.decode()
    assert "doesn’t exist" in page
    assert "acme" not in page


def test_a_quota_editor_edits_only_their_own_tenants_quotas(scenes, acme, globex):
    editor = signed_in(make_operator("quinn", globex, permissions=("tasks.view_tenant", "tasks.change_tenant")))
    quotas = {"max_running": 9, "max_queued": 9, "weight": 9, "_save": "Save"}
    assert editor.get(reverse("admin:tasks_tenant_change", args=[acme.pk])).status_code == 302
    assert editor.post(reverse("admin:tasks_tenant_change", args=[acme.pk]), quotas).status_code == 302
    assert editor.post(reverse("admin:tasks_tenant_change", args=[globex.pk]), quotas).status_code == 302
    acme.refresh_from_db()
    globex.refresh_from_db()
    assert (acme.max_running, globex.max_running) == (4, 9)


@pytest.mark.parametrize(("field", "value", "setting"), [
    ("weight", 11, "LONGHAUL_MAX_TENANT_WEIGHT"), ("max_running", 51, "LONGHAUL_MAX_RUNNING"),
    ("max_queued", 10_001, "LONGHAUL_MAX_QUEUED"),
])
def test_a_tenant_admin_cannot_raise_their_quotas_past_the_systems_ceilings(scenes, globex, field, value, setting):
    editor = signed_in(make_operator("quinn", globex, permissions=("tasks.view_tenant", "tasks.change_tenant")))
    quotas = {"max_running": 4, "max_queued": 100, "weight": 1, field: value, "_save": "Save"}
    response = editor.post(reverse("admin:tasks_tenant_change", args=[globex.pk]), quotas)
    assert response.status_code == 200  # the form again, with the error on the field
    assert setting in " ".join(response.context["adminform"].form.errors[field])
    globex.refresh_from_db()
    assert (globex.max_running, globex.max_queued, globex.weight) == (4, 100, 1)
    assert not AuditEntry.objects.filter(action="tenant.quotas").exists()


def test_the_ceilings_hold_for_code_too(globex):
    with pytest.raises(InvalidInput, match="weight must be a whole number from 0 to 10"):
        actions.set_quotas(globex, user=None, quotas={"max_running": 2, "weight": 1000})
    with pytest.raises(InvalidInput, match="max_running must be a whole number"):
        actions.set_quotas(globex, user=None, quotas={"max_running": True})
    globex.refresh_from_db()
    assert (globex.max_running, globex.weight) == (4, 1)


def test_an_operator_without_the_change_permission_cannot_edit_quotas(olga_client, globex):
    response = olga_client.post(reverse("admin:tasks_tenant_change", args=[globex.pk]),
                                {"max_running": 9, "max_queued": 9, "weight": 9, "_save": "Save"})
    assert response.status_code == 403
    globex.refresh_from_db()
    assert globex.max_running == 4


@pytest.mark.parametrize(("action", "noun"), [
    ("cancel_tasks", "tasks"), ("pause_tasks", "tasks"), ("resume_tasks", "tasks"), ("requeue_failed_tasks", "tasks"),
    ("retry_notifications", "notifications"), ("release_leases", "leases"),
])
def test_an_action_on_another_tenants_task_has_no_effect(olga_client, acme, alice, scenes, action, noun):
    # A task each action could move, were it in scope.
    theirs = {
        "cancel_tasks": make_task(acme, alice, status=S.QUEUED),
        "pause_tasks": make_task(acme, alice, status=S.QUEUED),
        "resume_tasks": make_task(acme, alice, status=S.PAUSED),
        "requeue_failed_tasks": scenes["acme"].task,
        "retry_notifications": make_task(acme, alice, status=S.SUCCEEDED,
                                         notification_status=NotificationStatus.DEAD_LETTER),
        "release_leases": make_task(acme, alice, status=S.RUNNING, lease_owner="w:1"),
    }[action]
    before = Task.objects.filter(pk=theirs.pk).values().get()
    events = TaskEvent.objects.filter(task=theirs).count()
    audits = AuditEntry.objects.count()
    response = act(olga_client, "tasks_task", action, [theirs.pk])
    assert said(response) == [f"No {noun} were changed."]
    assert Task.objects.filter(pk=theirs.pk).values().get() == before
    assert TaskEvent.objects.filter(task=theirs).count() == events
    assert AuditEntry.objects.count() == audits


def test_an_action_on_a_mixed_selection_changes_only_the_operators_tasks(olga_client, olga, acme, alice, globex,
                                                                         charlie):
    mine = make_task(globex, charlie, status=S.RUNNING)
    theirs = make_task(acme, alice, status=S.RUNNING)
    response = act(olga_client, "tasks_task", "cancel_tasks", [mine.pk, theirs.pk])
    assert said(response) == ["1 task cancelled."]
    assert Task.objects.get(pk=mine.pk).status == S.CANCELLED
    assert Task.objects.get(pk=theirs.pk).status == S.RUNNING
    assert list(AuditEntry.objects.values_list("actor_id", "tenant_id")) == [(olga.pk, globex.pk)]


def test_acknowledging_another_tenants_alert_has_no_effect(olga_client, scenes):
    theirs = scenes["acme"].alert
    act(olga_client, "tasks_alert", "acknowledge_alerts", [theirs.pk])
    theirs.refresh_from_db()
    assert theirs.acknowledged_at is None
    assert not AuditEntry.objects.filter(action="alert.acknowledge").exists()


def test_the_index_shows_only_the_operators_open_alerts(olga_client, scenes):
    page = olga_client.get(reverse("admin:index")).content.decode()
    assert scenes["globex"].alert.message in page
    assert scenes["acme"].alert.message not in page


def test_system_alerts_without_a_tenant_are_for_superusers_only(olga_client, scenes):
    Alert.objects.create(kind=Alert.Kind.QUOTA_REJECTIONS, created_at=scenes["globex"].alert.created_at,
                         message="the system queue is full")
    assert "the system queue is full" not in olga_client.get(reverse("admin:index")).content.decode()


def test_a_staff_user_who_is_only_a_plain_member_sees_nothing(scenes, globex):
    member = make_operator("mick", globex, role=Membership.Role.MEMBER)
    client = signed_in(member)
    for model in MODELS:
        assert listed(changelist(client, model)) == [], model


def test_an_operator_with_view_permissions_only_cannot_run_actions(scenes, globex, charlie):
    viewer = make_operator("vera", globex, permissions=("tasks.view_task",))
    mine = make_task(globex, charlie, status=S.RUNNING)
    audits = AuditEntry.objects.count()
    response = act(signed_in(viewer), "tasks_task", "cancel_tasks", [mine.pk])
    assert "cancel_tasks" not in response.content.decode()
    assert Task.objects.get(pk=mine.pk).status == S.RUNNING
    assert AuditEntry.objects.count() == audits


def test_a_staff_user_without_model_permissions_gets_no_lists(scenes, globex):
    bare = make_operator("bart", globex, permissions=())
    assert signed_in(bare).get(reverse("admin:tasks_task_changelist")).status_code == 403


def test_an_operator_sees_only_their_tenants_api_tokens_and_never_a_whole_key(acme, alice, globex, charlie):
    theirs, own = Token.objects.create(user=alice), Token.objects.create(user=charlie)
    operator = make_operator("tokens", globex, permissions=("authtoken.view_tokenproxy", "authtoken.delete_tokenproxy"))
    root = User.objects.create_superuser("root", password="root-password-1")

    client = signed_in(operator)
    response = changelist(client, "authtoken_tokenproxy")
    assert [token.key for token in listed(response)] == [own.key]
    assert own.key not in response.content.decode()  # a prefix names it; the whole key is a credential
    assert client.get(reverse("admin:authtoken_tokenproxy_change", args=[alice.pk])).status_code in (302, 404)
    assert client.post(reverse("admin:authtoken_tokenproxy_delete", args=[alice.pk]), {"post": "yes"}).status_code \
        in (302, 404)
    assert Token.objects.filter(key=theirs.key).exists()

    # A user who also belongs to another tenant is not this operator's to manage.
    Membership.objects.create(user=charlie, tenant=acme)
    assert listed(changelist(client, "authtoken_tokenproxy")) == []
    assert {t.key for t in listed(changelist(signed_in(root), "authtoken_tokenproxy"))} == {theirs.key, own.key}
