"""The task REST API: submit, read, watch, stop; one error shape; tenant walls."""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
import time_machine

from tasks import clock, jobs
from tasks.models import AuditEntry, IdempotencyRecord, Task, TaskEvent
from tests.conftest import api_client_for, make_user
from tests.factories import make_task

pytestmark = pytest.mark.django_db
SLEEP = {"kind": "sleep", "name": "nap", "input": {"steps": 2}}


def submit(client, body=None, key: str | None = "key-1"):
    headers = {"HTTP_IDEMPOTENCY_KEY": key} if key else {}
    return client.post("/api/tasks", body if body is not None else SLEEP, format="json", **headers)


def assert_error(response, status: int, code: str, field: str | None = None):
    assert response.status_code == status, response.content
    body = response.json()
    assert body["code"] == code
    assert body["error"]
    if field:
        assert body["field"] == field


@pytest.mark.smoke
def test_it_creates_a_task_and_returns_its_public_shape(alice_api):
    response = submit(alice_api)
    assert response.status_code == 201
    body = response.json()
    assert body["kind"] == "sleep" and body["name"] == "nap"
    assert body["status"] == "running"
    assert response["Location"] == f"/api/tasks/{body['id']}"
    assert "fencing_token" not in body and "lease_owner" not in body and "error_detail" not in body
    assert str(Task.objects.get().public_id) == body["id"]


def test_it_returns_the_same_task_for_a_repeated_key(alice_api):
    first = submit(alice_api)
    second = submit(alice_api)
    assert first.status_code == 201 and second.status_code == 200
    assert first.json()["id"] == second.json()["id"]
    assert Task.objects.count() == 1


def test_it_refuses_a_reused_key_with_a_different_request(alice_api):
    submit(alice_api)
    response = submit(alice_api, {**SLEEP, "input": {"steps": 3}})
    assert_error(response, 409, "idempotency_key_reused")
    assert Task.objects.count() == 1


def test_an_expired_key_starts_a_new_task(alice_api, settings):
    first = submit(alice_api)
    with time_machine.travel(clock.now() + timedelta(seconds=settings.LONGHAUL_IDEMPOTENCY_TTL + 1), tick=False):
        second = submit(alice_api)
    assert second.status_code == 201
    assert first.json()["id"] != second.json()["id"]
    assert IdempotencyRecord.objects.count() == 1


def test_keys_are_per_user(alice_api, bob):
    submit(alice_api)
    response = submit(api_client_for(bob))
    assert response.status_code == 201
    assert Task.objects.count() == 2


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"kind": "nope", "input": {}}, "kind"),
        ({"input": {}}, "kind"),
        ({"kind": "sleep", "input": {"steps": 0}}, "input.steps"),
        ({"kind": "sleep", "input": {"steps": 2, "extra": 1}}, "input.extra"),
        ({"kind": "sleep", "input": "steps"}, "input"),
        ({"kind": "sleep", "input": {}, "budget": {"max_steps": -1}}, "budget.max_steps"),
        ({"kind": "sleep", "input": {}, "budget": {"max_retries": 10**9}}, "budget.max_retries"),
        ({"kind": "sleep", "input": {}, "priority": 99}, "priority"),
        ({"kind": "sleep", "input": {}, "name": "x" * 201}, "name"),
        ({"kind": "sleep", "input": {}, "thread": "not-a-uuid"}, "thread"),
        ({"kind": "sleep", "input": {}, "thread": str(uuid.uuid4())}, "thread"),
    ],
)
def test_bad_input_gets_a_400_naming_the_field_and_writes_nothing(alice_api, body, field):
    response = submit(alice_api, body)
    assert_error(response, 400, "invalid_input", field)
    assert Task.objects.count() == 0
    assert IdempotencyRecord.objects.count() == 0


def test_a_bad_idempotency_key_is_refused(alice_api):
    assert_error(submit(alice_api, key="has space"), 400, "invalid_input", "Idempotency-Key")


def test_a_body_that_is_not_json_is_refused(alice_api):
    response = alice_api.post("/api/tasks", "{not json", content_type="application/json")
    assert_error(response, 400, "malformed_json")


def test_over_the_queue_quota_it_answers_429_and_writes_nothing(alice_api, acme):
    acme.max_running = 0
    acme.max_queued = 2
    acme.save()
    assert submit(alice_api, key="a").status_code == 201
    assert submit(alice_api, key="b").status_code == 201
    response = submit(alice_api, key="c")
    assert_error(response, 429, "queue_full")
    assert int(response["Retry-After"]) > 0
    assert Task.objects.count() == 2
    assert not IdempotencyRecord.objects.filter(key="c").exists()


def test_it_lists_tasks_with_filters_and_pagination(alice_api, acme, alice):
    for i in range(3):
        make_task(acme, alice, status="queued", name=f"q{i}")
    make_task(acme, alice, status="succeeded", name="done")
    everything = alice_api.get("/api/tasks").json()
    assert len(everything["results"]) == 4
    finished = alice_api.get("/api/tasks?status=succeeded").json()["results"]
    assert [t["name"] for t in finished] == ["done"]
    first_page = alice_api.get("/api/tasks?limit=2").json()
    assert len(first_page["results"]) == 2 and first_page["next"]
    assert_error(alice_api.get("/api/tasks?status=bogus"), 400, "invalid_input", "status")


def test_another_tenants_task_answers_404_on_every_verb(alice_api, charlie_api):
    task_id = submit(alice_api).json()["id"]
    for path in ("", "/events", "/result"):
        assert_error(charlie_api.get(f"/api/tasks/{task_id}{path}"), 404, "not_found")
    for verb in ("cancel", "pause", "resume"):
        assert_error(charlie_api.post(f"/api/tasks/{task_id}/{verb}", {}, format="json"), 404, "not_found")
    assert charlie_api.get("/api/tasks").json()["results"] == []
    task = Task.objects.get()
    assert task.cancel_requested_at is None and task.pause_requested_at is None
    assert not AuditEntry.objects.exists()


def test_a_member_does_not_see_a_colleagues_task_but_a_tenant_admin_does(alice_api, acme):
    task_id = submit(alice_api).json()["id"]
    bob_api = api_client_for(make_user("bob2", acme))
    assert bob_api.get(f"/api/tasks/{task_id}").status_code == 404
    admin_api = api_client_for(make_user("dora", acme, role="admin"))
    assert admin_api.get(f"/api/tasks/{task_id}").status_code == 200


def test_an_invalid_task_id_is_a_404_in_the_error_shape(alice_api):
    assert_error(alice_api.get("/api/tasks/not-a-uuid"), 404, "not_found")
    assert_error(alice_api.get(f"/api/tasks/{uuid.uuid4()}"), 404, "not_found")


def test_events_page_from_an_offset_with_next_after(alice_api, settings):
    settings.LONGHAUL_STEP_SLICE_MS = 0
    task_id = submit(alice_api).json()["id"]
    task = Task.objects.get()
    jobs.advance(task.pk)
    jobs.advance(task.pk)
    page = alice_api.get(f"/api/tasks/{task_id}/events?after=0&limit=2").json()
    assert [e["seq"] for e in page["results"]] == [1, 2]
    assert page["next_after"] == 2
    rest = alice_api.get(f"/api/tasks/{task_id}/events?after=2").json()
    assert [e["seq"] for e in rest["results"]] == list(range(3, TaskEvent.objects.count() + 1))
    assert rest["results"][-1]["kind"] == "succeeded"
    empty = alice_api.get(f"/api/tasks/{task_id}/events?after={rest['next_after']}").json()
    assert empty == {"results": [], "next_after": rest["next_after"]}
    assert_error(alice_api.get(f"/api/tasks/{task_id}/events?after=-1"), 400, "invalid_input", "after")


def test_the_result_is_not_ready_until_there_is_one(alice_api, settings):
    settings.LONGHAUL_STEP_SLICE_MS = 0
    task_id = submit(alice_api).json()["id"]
    assert_error(alice_api.get(f"/api/tasks/{task_id}/result"), 409, "not_ready")
    task = Task.objects.get()
    jobs.advance(task.pk)
    jobs.advance(task.pk)
    body = alice_api.get(f"/api/tasks/{task_id}/result").json()
    assert body["status"] == "succeeded"
    assert body["result_version"] == 1
    assert body["result"]["steps"] == 2


def test_cancel_answers_202_and_repeating_it_is_harmless(alice_api):
    task_id = submit(alice_api).json()["id"]
    first = alice_api.post(f"/api/tasks/{task_id}/cancel", {"reason": "no longer needed"}, format="json")
    assert first.status_code == 202
    assert first.json()["status"] == "cancelled"
    again = alice_api.post(f"/api/tasks/{task_id}/cancel", {}, format="json")
    assert again.status_code == 202
    assert Task.objects.get().events.filter(kind="cancelled").count() == 1


def test_pause_and_resume_over_the_api(alice_api):
    task_id = submit(alice_api).json()["id"]
    paused = alice_api.post(f"/api/tasks/{task_id}/pause", {}, format="json")
    assert paused.status_code == 202 and paused.json()["status"] == "paused"
    assert_error(alice_api.post(f"/api/tasks/{task_id}/pause", {}, format="json"), 409, "not_pausable")
    resumed = alice_api.post(f"/api/tasks/{task_id}/resume", {}, format="json")
    assert resumed.status_code == 202 and resumed.json()["status"] == "running"
    assert_error(alice_api.post(f"/api/tasks/{task_id}/resume", {}, format="json"), 409, "not_resumable")


def test_the_api_requires_authentication(client):
    response = client.get("/api/tasks")
    assert response.status_code in (401, 403)
    assert response.json()["code"] == "not_authenticated"


def test_session_writes_need_a_csrf_token(alice):
    from django.test import Client

    browser = Client(enforce_csrf_checks=True)
    browser.force_login(alice)
    response = browser.post("/api/tasks", SLEEP, content_type="application/json")
    assert response.status_code == 403
    assert Task.objects.count() == 0
