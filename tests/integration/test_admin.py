"""The operators' admin: read-only runtime rows, actions that call the runtime and audit, dead letters,
alerts on the index, tenant quotas and counts. Tenant walls are in test_admin_isolation.py."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import pytest
from django.contrib.auth.models import Permission, User
from django.db import connection, transaction
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from chat.models import Message, Run, Thread
from tasks import clock, leases
from tasks.errors import LeaseLost
from tasks.events import NewEvent, append
from tasks.models import Alert, AuditEntry, Checkpoint, Membership, Operation, Task, TaskEvent, Tenant
from tasks.statuses import NotificationStatus, TaskStatus
from tests.conftest import make_user
from tests.factories import make_task

S = TaskStatus
N = NotificationStatus
pytestmark = pytest.mark.django_db

# What a tenant operator is given; the report with this change names the same list.
OPERATOR_PERMISSIONS = (
    "tasks.view_task", "tasks.change_task", "tasks.view_taskevent", "tasks.view_checkpoint",
    "tasks.view_operation", "tasks.view_auditentry", "tasks.view_alert", "tasks.change_alert",
    "tasks.view_tenant", "chat.view_thread", "chat.view_run", "chat.view_message",
)


# --- people and scenes ----------------------------------------------------------------


def make_operator(username: str, tenant: Tenant, *, permissions: tuple[str, ...] = OPERATOR_PERMISSIONS,
                  role: str = Membership.Role.ADMIN) -> User:
    user = make_user(username, tenant, role=role)
    user.is_staff = True
    user.save(update_fields=["is_staff"])
    for name in permissions:
        app_label, codename = name.split(".")
        user.user_permissions.add(Permission.objects.get(content_type__app_label=app_label, codename=codename))
    return User.objects.get(pk=user.pk)  # a fresh instance: permissions are cached per instance


def signed_in(user: User) -> Client:
    client = Client()
    client.force_login(user)
    return client


@dataclass(frozen=True)
class Scene:
    """One of each admin-visible row, all in one tenant."""

    task: Task
    event: TaskEvent
    checkpoint: Checkpoint
    operation: Operation
    audit: AuditEntry
    alert: Alert
    thread: Thread
    run: Run
    message: Message


def stage(tenant: Tenant, owner: User) -> Scene:
    now = clock.now()
    thread = Thread.objects.create(tenant=tenant, owner=owner, title=f"{tenant.slug} thread")
    task = make_task(tenant, owner, status=S.FAILED, name=f"{tenant.slug} task", thread=thread,
                     error_class="poison", error_message=f"{tenant.slug} step kept crashing", current_step=1,
                     started_at=now - timedelta(minutes=2), finished_at=now)
    with transaction.atomic():
        append(task, [NewEvent("queued"), NewEvent("failed", {"error_class": "poison"})], status=task.status, at=now)
    checkpoint = Checkpoint.objects.create(task=task, step=1, fencing_token=1, state={"n": 1}, schema_version=1,
                                           at=now)
    operation = Operation.objects.create(task=task, key=f"{task.pk}:1:0", step=1, n=0, kind="tool", name="search",
                                         args_digest="d", fencing_token=1, status="succeeded", created_at=now)
    audit = AuditEntry.objects.create(tenant=tenant, actor=owner, action="task.cancel", target_type="task",
                                      target_id=str(task.public_id), at=now)
    alert = Alert.objects.create(kind=Alert.Kind.POISON, tenant=tenant, task=task, created_at=now,
                                 message=f"{tenant.slug} task gave up")
    run = Run.objects.create(thread=thread, tenant=tenant, kind=Run.Kind.NOTIFICATION, status=Run.Status.SUCCEEDED,
                             task=task, task_version=1, created_at=now, idempotency_key=f"task:{task.pk}:1:0")
    message = Message.objects.create(thread=thread, role=Message.Role.USER, content=f"{tenant.slug} asks",
                                     created_at=now)
    return Scene(task=task, event=TaskEvent.objects.filter(task=task).first(), checkpoint=checkpoint,
                 operation=operation, audit=audit, alert=alert, thread=thread, run=run, message=message)


def changelist(client: Client, name: str, query: dict | None = None):
    response = client.get(reverse(f"admin:{name}_changelist"), query or {})
    assert response.status_code == 200, response
    return response


def listed(response) -> list:
    return list(response.context["cl"].result_list)


def act(client: Client, model: str, action: str, ids: list[int], *, follow: bool = True, **extra):
    """Post an admin action as the changelist's form does; by default follow to the page that says the outcome."""
    return client.post(reverse(f"admin:{model}_changelist"),
                       {"action": action, "index": 0, "_selected_action": ids, **extra}, follow=follow)


def said(response) -> list[str]:
    """The messages shown on the page the action led to."""
    return [str(m) for m in response.context["messages"]]


def event_kinds(task: Task) -> list[str]:
    return list(TaskEvent.objects.filter(task=task).order_by("seq").values_list("kind", flat=True))


# --- the task list ----------------------------------------------------------------------


def test_a_superuser_sees_every_tenants_tasks(root_client, acme, alice, globex, charlie):
    acme_task = make_task(acme, alice, name="acme nap")
    globex_task = make_task(globex, charlie, name="globex nap")
    response = changelist(root_client, "tasks_task")
    assert {t.pk for t in listed(response)} == {acme_task.pk, globex_task.pk}


def test_the_task_list_shows_duration_error_class_and_notification_state(root_client, acme, alice):
    now = clock.now()
    make_task(acme, alice, status=S.FAILED, name="long nap", error_class="timeout",
              started_at=now - timedelta(minutes=1, seconds=30), finished_at=now,
              notification_status=N.DELIVERED)
    content = changelist(root_client, "tasks_task").content.decode()
    assert "long nap" in content
    assert "1m 30s" in content
    assert "timeout" in content
    assert "delivered" in content


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        ({"status__exact": "failed"}, {"failed", "poison"}),
        ({"kind": "research"}, {"research"}),
        ({"error_class__exact": "poison"}, {"poison"}),
        ({"notification_status__exact": "dead_letter"}, {"dead letter"}),
        ({"q": "dead"}, {"dead letter"}),
    ],
)
def test_it_filters_tasks_by_status_kind_error_class_notification_state_and_name(
        root_client, acme, alice, query, expected):
    make_task(acme, alice, status=S.QUEUED, name="queued")
    make_task(acme, alice, status=S.FAILED, name="failed", error_class="timeout")
    make_task(acme, alice, status=S.FAILED, name="poison", error_class="poison")
    make_task(acme, alice, status=S.RUNNING, name="research", kind="research")
    make_task(acme, alice, status=S.SUCCEEDED, name="dead letter", notification_status=N.DEAD_LETTER)
    assert {t.name for t in listed(changelist(root_client, "tasks_task", query))} == expected


def test_it_filters_tasks_by_tenant(root_client, acme, alice, globex, charlie):
    make_task(acme, alice, name="acme nap")
    make_task(globex, charlie, name="globex nap")
    response = changelist(root_client, "tasks_task", {"tenant__id__exact": globex.pk})
    assert [t.name for t in listed(response)] == ["globex nap"]


# --- the task page ----------------------------------------------------------------------


def test_the_task_page_shows_its_latest_events_by_seq_and_links_to_the_rest(root_client, acme, alice):
    scene = stage(acme, alice)
    with transaction.atomic():
        append(scene.task, [NewEvent(f"step_{n}") for n in range(30)], status=scene.task.status, at=clock.now())
    response = root_client.get(reverse("admin:tasks_task_change", args=[scene.task.pk]))
    content = response.content.decode()
    assert response.status_code == 200
    assert "step_29" in content and "step_10" in content
    assert "step_9<" not in content  # only the last 20 of 32
    assert content.index("step_10") < content.index("step_29")
    assert "all 32 events" in content
    assert f"task__id__exact={scene.task.pk}" in content
    assert "1 checkpoint</a>" in content and "1 operation</a>" in content
    assert reverse("admin:chat_run_changelist") in content and "kind__exact=notification" in content


def test_the_task_page_and_the_operation_list_show_the_pinned_versions(root_client, acme, alice):
    scene = stage(acme, alice)
    Task.objects.filter(pk=scene.task.pk).update(model_name="openai:pinned-model-7", prompt_version="p-42",
                                                 tool_protocol="tools/9")
    Operation.objects.filter(task=scene.task).update(version="search longhaul-tools/77")
    content = root_client.get(reverse("admin:tasks_task_change", args=[scene.task.pk])).content.decode()
    assert "openai:pinned-model-7" in content and "p-42" in content and "tools/9" in content
    assert "search longhaul-tools/77" in changelist(root_client, "tasks_operation").content.decode()


def test_the_events_link_lists_that_tasks_events_in_seq_order(root_client, acme, alice):
    scene = stage(acme, alice)
    stage(acme, alice)  # another task with events of its own
    response = changelist(root_client, "tasks_taskevent", {"task__id__exact": scene.task.pk})
    assert [(e.task_id, e.seq) for e in listed(response)] == [(scene.task.pk, 1), (scene.task.pk, 2)]


def test_the_notification_runs_link_lists_that_tasks_notification_runs(root_client, acme, alice):
    scene = stage(acme, alice)
    Run.objects.create(thread=scene.thread, tenant=acme, kind=Run.Kind.CHAT, status=Run.Status.SUCCEEDED,
                       task=scene.task, created_at=clock.now())
    response = changelist(root_client, "chat_run", {"task__id__exact": scene.task.pk, "kind__exact": "notification"})
    assert [r.pk for r in listed(response)] == [scene.run.pk]


def test_only_a_superuser_reads_a_tasks_internal_error_detail(root_client, acme, alice):
    task = make_task(acme, alice, status=S.FAILED, error_detail="Traceback: secret-frame")
    operator = make_operator("olga", acme)
    url = reverse("admin:tasks_task_change", args=[task.pk])
    assert "secret-frame" in root_client.get(url).content.decode()
    response = signed_in(operator).get(url)
    assert response.status_code == 200
    assert "secret-frame" not in response.content.decode()


# --- read-only --------------------------------------------------------------------------


def test_posting_the_change_form_does_not_change_a_task(root_client, acme, alice):
    task = make_task(acme, alice, status=S.RUNNING, name="nap", priority=0)
    url = reverse("admin:tasks_task_change", args=[task.pk])
    assert 'name="_save"' not in root_client.get(url).content.decode()
    response = root_client.post(url, {"name": "renamed", "status": "succeeded", "priority": 9, "_save": "Save"})
    assert response.status_code == 403
    fresh = Task.objects.get(pk=task.pk)
    assert (fresh.name, fresh.status, fresh.priority, fresh.version) == ("nap", S.RUNNING, 0, task.version)


@pytest.mark.parametrize("model", ["tasks_task", "tasks_taskevent", "tasks_auditentry", "tasks_alert",
                                   "chat_thread", "chat_run", "chat_message"])
def test_runtime_rows_cannot_be_added_edited_or_deleted(root_client, acme, alice, model):
    scene = stage(acme, alice)
    obj = {"tasks_task": scene.task, "tasks_taskevent": scene.event, "tasks_auditentry": scene.audit,
           "tasks_alert": scene.alert, "chat_thread": scene.thread, "chat_run": scene.run,
           "chat_message": scene.message}[model]
    assert root_client.get(reverse(f"admin:{model}_add")).status_code == 403
    assert root_client.post(reverse(f"admin:{model}_delete", args=[obj.pk]), {"post": "yes"}).status_code == 403
    assert root_client.post(reverse(f"admin:{model}_change", args=[obj.pk]), {"_save": "Save"}).status_code == 403
    assert type(obj).objects.filter(pk=obj.pk).exists()


# --- actions ----------------------------------------------------------------------------


def test_the_cancel_action_cancels_and_audits_with_the_admin_as_actor(root_client, root, acme, alice):
    task = make_task(acme, alice, status=S.QUEUED)
    response = act(root_client, "tasks_task", "cancel_tasks", [task.pk])
    assert response.redirect_chain == [(reverse("admin:tasks_task_changelist"), 302)]
    task.refresh_from_db()
    assert task.status == S.CANCELLED
    assert task.cancel_requested_by_id == root.pk
    entry = AuditEntry.objects.get(action="task.cancel")
    assert (entry.actor_id, entry.tenant_id, entry.target_id) == (root.pk, acme.pk, str(task.public_id))
    assert said(response) == ["1 task cancelled."]


def test_the_cancel_action_says_what_happened_to_each_task(root_client, acme, alice):
    now = clock.now()
    queued = [make_task(acme, alice, status=S.QUEUED) for _ in range(3)]
    held = make_task(acme, alice, status=S.RUNNING, lease_owner="w1:1", lease_expires_at=now + timedelta(seconds=30))
    done = make_task(acme, alice, status=S.SUCCEEDED)
    response = act(root_client, "tasks_task", "cancel_tasks", [t.pk for t in [*queued, held, done]])
    assert said(response) == [
        "3 tasks cancelled, 1 task will stop at its next safe point, 1 task was already finished."
    ]
    held.refresh_from_db()
    assert held.status == S.RUNNING and held.cancel_requested_at is not None
    assert Task.objects.get(pk=done.pk).status == S.SUCCEEDED
    assert AuditEntry.objects.filter(action="task.cancel").count() == 4


def test_pause_and_resume_actions_call_the_runtime_and_audit(root_client, root, acme, alice):
    task = make_task(acme, alice, status=S.QUEUED)
    response = act(root_client, "tasks_task", "pause_tasks", [task.pk])
    assert said(response) == ["1 task paused."]
    assert Task.objects.get(pk=task.pk).status == S.PAUSED
    response = act(root_client, "tasks_task", "resume_tasks", [task.pk])
    assert said(response) == ["1 task resumed."]
    assert Task.objects.get(pk=task.pk).status in (S.QUEUED, S.RUNNING)
    actions = list(AuditEntry.objects.filter(actor=root).order_by("at", "pk").values_list("action", flat=True))
    assert actions == ["task.pause", "task.resume"]


def test_pause_and_resume_refuse_tasks_they_cannot_move(root_client, acme, alice):
    done = make_task(acme, alice, status=S.SUCCEEDED)
    running = make_task(acme, alice, status=S.RUNNING)
    assert said(act(root_client, "tasks_task", "pause_tasks", [done.pk])) == ["1 task was not running."]
    assert said(act(root_client, "tasks_task", "resume_tasks", [running.pk])) == ["1 task was not paused or partial."]
    assert not AuditEntry.objects.exists()


def test_requeue_gives_a_failed_task_a_new_attempt_from_its_checkpoint_with_a_fresh_retry_budget(
        root_client, root, acme, alice):
    now = clock.now()
    task = make_task(acme, alice, status=S.FAILED, error_class="poison", error_message="kept crashing",
                     retries=5, attempts=4, current_step=2, finished_at=now, started_at=now,
                     queue_deadline_at=now - timedelta(hours=1))
    Checkpoint.objects.create(task=task, step=2, fencing_token=3, state={"done": 2}, schema_version=1, at=now)
    response = act(root_client, "tasks_task", "requeue_failed_tasks", [task.pk])
    assert said(response) == ["1 task requeued with a fresh retry budget."]
    task.refresh_from_db()
    assert task.status == S.RUNNING  # requeued, then admitted: acme has free slots
    assert (task.retries, task.attempts, task.current_step) == (0, 0, 2)
    assert (task.error_class, task.error_message, task.finished_at) == ("", "", None)
    assert task.queue_deadline_at > now
    assert event_kinds(task)[-2:] == ["queued", "admitted"]
    entry = AuditEntry.objects.get(action="task.requeue")
    assert entry.actor_id == root.pk
    assert entry.details["error_class"] == "poison" and entry.details["retries"] == 5


def test_requeue_leaves_tasks_that_did_not_fail(root_client, acme, alice):
    done = make_task(acme, alice, status=S.SUCCEEDED)
    response = act(root_client, "tasks_task", "requeue_failed_tasks", [done.pk])
    assert said(response) == ["1 task had not failed."]
    assert Task.objects.get(pk=done.pk).status == S.SUCCEEDED
    assert not AuditEntry.objects.exists()


def test_releasing_a_stuck_lease_fences_the_old_holder(root_client, root, acme, alice):
    now = clock.now()
    task = make_task(acme, alice, status=S.RUNNING, lease_owner="stuck:1", fencing_token=7,
                     lease_expires_at=now + timedelta(seconds=30), heartbeat_at=now)
    response = act(root_client, "tasks_task", "release_leases", [task.pk])
    assert said(response) == ["1 lease released."]
    task.refresh_from_db()
    assert (task.status, task.lease_owner, task.fencing_token) == (S.RUNNING, "", 8)
    assert task.next_run_at <= clock.now()
    # The old holder can neither renew nor write.
    assert leases.renew(task.pk, owner="stuck:1", token=7, now=clock.now()) is False
    with pytest.raises(LeaseLost), transaction.atomic():
        leases.lock_fenced(task.pk, 7)
    entry = AuditEntry.objects.get(action="task.release_lease")
    assert entry.actor_id == root.pk and entry.details["lease_owner"] == "stuck:1"
    released = TaskEvent.objects.get(task=task, kind="lease_released")
    assert "stuck" not in str(released.data)  # the holder's name is internal


def test_releasing_says_when_nobody_held_the_lease(root_client, acme, alice):
    task = make_task(acme, alice, status=S.RUNNING)
    assert said(act(root_client, "tasks_task", "release_leases", [task.pk])) == ["1 task held no lease."]
    assert Task.objects.get(pk=task.pk).fencing_token == 0


def test_retrying_a_dead_lettered_notification_gives_it_fresh_attempts(root_client, root, acme, alice):
    thread = Thread.objects.create(tenant=acme, owner=alice)
    task = make_task(acme, alice, status=S.SUCCEEDED, thread=thread, notification_status=N.DEAD_LETTER,
                     notification_attempt_count=5, event_version=2, notified_version=1,
                     notification_error="RuntimeError: model down")
    delivered = make_task(acme, alice, status=S.SUCCEEDED, notification_status=N.DELIVERED)
    response = act(root_client, "tasks_task", "retry_notifications", [task.pk, delivered.pk])
    assert said(response) == ["1 notification will be delivered again, 1 notification was not dead-lettered."]
    task.refresh_from_db()
    assert (task.notification_status, task.notification_attempt_count) == (N.PENDING, 0)
    assert Task.objects.get(pk=delivered.pk).notification_status == N.DELIVERED
    entry = AuditEntry.objects.get(action="task.notification_retry")
    assert entry.actor_id == root.pk and entry.target_id == str(task.public_id)


def test_an_action_with_nothing_in_scope_says_nothing_was_changed(root_client, acme, alice):
    response = act(root_client, "tasks_task", "cancel_tasks", [999_999])
    assert said(response) == ["No tasks were changed."]


# --- dead letters -----------------------------------------------------------------------


def test_the_dead_letter_view_lists_dead_letters_with_their_error_and_attempts(root_client, acme, alice):
    now = clock.now()
    make_task(acme, alice, status=S.SUCCEEDED, name="told", notification_status=N.DELIVERED)
    make_task(acme, alice, status=S.SUCCEEDED, name="untold", notification_status=N.DEAD_LETTER,
              notification_attempt_count=5, notification_error="RuntimeError: model down",
              next_notification_at=now)
    response = changelist(root_client, "tasks_task", {"trouble": "dead_letter"})
    content = response.content.decode()
    assert [t.name for t in listed(response)] == ["untold"]
    assert "RuntimeError: model down" in content and "5 deliveries" in content
    assert "retry_notifications" in content


@pytest.mark.parametrize(("trouble", "expected"), [("failed", {"poisoned", "timed out"}), ("poison", {"poisoned"})])
def test_the_failed_and_poison_views_show_error_class_and_message(root_client, acme, alice, trouble, expected):
    make_task(acme, alice, status=S.FAILED, name="poisoned", error_class="poison", error_message="gave up after 5")
    make_task(acme, alice, status=S.FAILED, name="timed out", error_class="timeout", error_message="too slow")
    make_task(acme, alice, status=S.SUCCEEDED, name="fine")
    response = changelist(root_client, "tasks_task", {"trouble": trouble})
    assert {t.name for t in listed(response)} == expected
    assert "gave up after 5" in response.content.decode()
    assert "requeue_failed_tasks" in response.content.decode()


# --- alerts -----------------------------------------------------------------------------


def test_open_alerts_show_on_the_index_until_acknowledged(root_client, root, acme, alice):
    task = make_task(acme, alice, status=S.FAILED)
    alert = Alert.objects.create(kind=Alert.Kind.POISON, tenant=acme, task=task, created_at=clock.now(),
                                 message="task 'nap' gave up after 5 attempts")
    index = reverse("admin:index")
    assert "gave up after 5 attempts" in root_client.get(index).content.decode()
    response = act(root_client, "tasks_alert", "acknowledge_alerts", [alert.pk], follow=False, next=index)
    assert response.status_code == 302 and response["Location"] == index
    assert "gave up after 5 attempts" not in root_client.get(index).content.decode()
    alert.refresh_from_db()
    assert alert.acknowledged_by_id == root.pk and alert.acknowledged_at is not None
    entry = AuditEntry.objects.get(action="alert.acknowledge")
    assert (entry.actor_id, entry.tenant_id, entry.target_id) == (root.pk, acme.pk, str(alert.pk))


def test_a_dead_letter_alert_links_to_the_dead_letter_view(root_client, acme, alice):
    task = make_task(acme, alice, status=S.SUCCEEDED, notification_status=N.DEAD_LETTER)
    Alert.objects.create(kind=Alert.Kind.DEAD_LETTER, tenant=acme, task=task, created_at=clock.now(),
                         message="notification dead-lettered")
    content = root_client.get(reverse("admin:index")).content.decode()
    dead_letters = reverse("admin:tasks_task_changelist") + "?trouble=dead_letter"
    assert f'href="{dead_letters}">Dead-lettered notification</a>' in content


def test_acknowledging_an_acknowledged_alert_says_so(root_client, acme):
    alert = Alert.objects.create(kind=Alert.Kind.STALLED, tenant=acme, created_at=clock.now(), message="m",
                                 acknowledged_at=clock.now())
    assert said(act(root_client, "tasks_alert", "acknowledge_alerts", [alert.pk])) == [
        "1 alert was already acknowledged."
    ]
    assert not AuditEntry.objects.exists()


# --- tenants ----------------------------------------------------------------------------


def test_the_tenant_list_counts_running_queued_and_failed_tasks(root_client, acme, alice, globex, charlie):
    for status in (S.RUNNING, S.WAITING_TOOL, S.RETRY_WAIT, S.QUEUED, S.QUEUED, S.QUEUED, S.FAILED, S.SUCCEEDED):
        make_task(acme, alice, status=status)
    make_task(globex, charlie, status=S.FAILED)
    counts = {t.slug: (t.running_count, t.queued_count, t.failed_count)
              for t in listed(changelist(root_client, "tasks_tenant"))}
    assert counts == {"acme": (3, 3, 1), "globex": (0, 0, 1)}


def test_the_tenant_list_costs_the_same_queries_for_more_tenants(root_client, acme, alice):
    make_task(acme, alice, status=S.QUEUED)
    with CaptureQueriesContext(connection) as few:
        changelist(root_client, "tasks_tenant")
    for n in range(5):
        Tenant.objects.create(slug=f"t{n}", name=f"T{n}")
    with CaptureQueriesContext(connection) as many:
        response = changelist(root_client, "tasks_tenant")
    assert len(listed(response)) == 6
    assert len(many) == len(few)


def test_editing_quotas_saves_them_audits_and_admits_waiting_tasks(root_client, root, acme, alice):
    acme.max_running = 0
    acme.save()
    waiting = make_task(acme, alice, status=S.QUEUED)
    url = reverse("admin:tasks_tenant_change", args=[acme.pk])
    response = root_client.post(url, {"max_running": 2, "max_queued": 100, "weight": 3, "slug": "hijacked",
                                      "_save": "Save"})
    assert response.status_code == 302
    acme.refresh_from_db()
    assert (acme.slug, acme.max_running, acme.max_queued, acme.weight) == ("acme", 2, 100, 3)
    entry = AuditEntry.objects.get(action="tenant.quotas")
    assert entry.actor_id == root.pk and entry.details == {"max_running": [0, 2], "weight": [1, 3]}
    assert Task.objects.get(pk=waiting.pk).status == S.RUNNING


# --- audit log and chat -----------------------------------------------------------------


def test_the_audit_log_filters_by_tenant_actor_action_and_day(root_client, acme, alice, bob, globex, charlie):
    now = clock.now()
    mine = AuditEntry.objects.create(tenant=acme, actor=alice, action="task.cancel", target_type="task",
                                     target_id="a", at=now)
    AuditEntry.objects.create(tenant=acme, actor=bob, action="task.cancel", target_type="task", target_id="b", at=now)
    AuditEntry.objects.create(tenant=acme, actor=alice, action="task.pause", target_type="task", target_id="c",
                              at=now)
    AuditEntry.objects.create(tenant=globex, actor=charlie, action="task.cancel", target_type="task",
                              target_id="d", at=now - timedelta(days=40))
    query = {"tenant__id__exact": acme.pk, "actor__id__exact": alice.pk, "action__exact": "task.cancel",
             "at__year": now.year, "at__month": now.month, "at__day": now.day}
    assert [e.pk for e in listed(changelist(root_client, "tasks_auditentry", query))] == [mine.pk]


@pytest.mark.parametrize("model", ["chat_thread", "chat_run", "chat_message", "tasks_checkpoint",
                                   "tasks_operation", "tasks_taskevent", "tasks_alert", "tasks_auditentry"])
def test_each_admin_lists_its_rows(root_client, acme, alice, model):
    scene = stage(acme, alice)
    expected = {"chat_thread": scene.thread, "chat_run": scene.run, "chat_message": scene.message,
                "tasks_checkpoint": scene.checkpoint, "tasks_operation": scene.operation,
                "tasks_taskevent": scene.event, "tasks_alert": scene.alert, "tasks_auditentry": scene.audit}[model]
    assert expected.pk in {row.pk for row in listed(changelist(root_client, model))}
    assert root_client.get(reverse(f"admin:{model}_change", args=[expected.pk])).status_code == 200
