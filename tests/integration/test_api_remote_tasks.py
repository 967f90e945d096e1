"""What the API shows of remote (MCP) tasks and their questions: bounded errors, the question's
form, structured answers checked before anything is written, and no server internals."""

from __future__ import annotations

import json

import pytest

from chat.models import Message, Thread
from tasks.models import AuditEntry, Task, TaskEvent
from tasks.statuses import NotificationStatus, TaskStatus
from tests.conftest import api_client_for
from tests.factories import make_task

pytestmark = pytest.mark.django_db

HANDLE = "remote-handle-7f3a9c"
FORM = {"type": "object", "required": ["title", "copies", "format"], "properties": {
    "title": {"type": "string", "maxLength": 80},
    "copies": {"type": "integer", "minimum": 1, "maximum": 10},
    "urgent": {"type": "boolean"},
    "format": {"type": "string", "enum": ["pdf", "html"]},
}}


@pytest.fixture
def servers_file(tmp_path, settings):
    path = tmp_path / "servers.json"
    path.write_text(json.dumps({"servers": {"reports-internal": {
        "transport": "http", "url": "http://127.0.0.1:9/mcp", "title": "Report Studio"}}}))
    settings.LONGHAUL_MCP_SERVERS = str(path)
    return path


def remote_task(tenant, owner, **fields) -> Task:
    values = {"kind": "mcp", "name": "build_report on Report Studio",
              "input": {"server": "reports-internal", "tool": "build_report", "arguments": {"quarter": "Q3"}},
              "remote_handle": HANDLE, "remote_server": "reports-internal"}
    return make_task(tenant, owner, **{**values, **fields})


def asking(tenant, owner, *, form=FORM, **fields) -> Task:
    return remote_task(tenant, owner, status=TaskStatus.WAITING_INPUT, question="How should the report look?",
                       question_form=form, waiting_reason="input", **fields)


# --- the task detail ---------------------------------------------------------------------------


def test_the_detail_has_bounded_notification_fields(acme, alice, alice_api):
    task = make_task(acme, alice, notification_status=NotificationStatus.RETRY, notification_attempt_count=3,
                     notification_error="x" * 4000)
    body = alice_api.get(f"/api/tasks/{task.public_id}").json()
    assert body["notification"]["status"] == "retry"
    assert body["notification"]["attempts"] == 3
    assert len(body["notification"]["last_error"]) == 500


def test_the_detail_shows_a_remote_tasks_poll_and_cancel_trouble_bounded(servers_file, acme, alice, alice_api):
    task = remote_task(acme, alice, status=TaskStatus.RUNNING, tracking_degraded=True,
                       remote_poll_error="the MCP server timed out " + "y" * 3900, remote_cancel_attempts=2,
                       remote_cancel_error="the MCP server did not answer " + "z" * 3900)
    body = alice_api.get(f"/api/tasks/{task.public_id}").json()
    assert body["tracking_degraded"] is True
    assert body["remote_error"].startswith("the MCP server timed out") and len(body["remote_error"]) == 500
    assert body["cancel_attempts"] == 2
    assert body["cancel_error"].startswith("the MCP server did not answer") and len(body["cancel_error"]) == 500


def test_the_detail_lists_the_questions_fields_in_order(servers_file, acme, alice, alice_api):
    task = asking(acme, alice)
    fields = alice_api.get(f"/api/tasks/{task.public_id}").json()["question_fields"]
    # PostgreSQL's jsonb keeps an object's keys in its own order, not the server's.
    by_name = {f["name"]: f for f in fields}
    assert {name: (f["type"], f["required"]) for name, f in by_name.items()} == {
        "title": ("text", True), "copies": ("integer", True), "urgent": ("boolean", False),
        "format": ("choice", True)}
    assert by_name["copies"]["minimum"] == 1 and by_name["copies"]["maximum"] == 10
    assert by_name["title"]["max_length"] == 80
    assert by_name["format"]["choices"] == ["pdf", "html"]


def test_a_free_text_question_has_no_fields(acme, alice, alice_api):
    task = make_task(acme, alice, status=TaskStatus.WAITING_INPUT, question="Which quarter?")
    assert alice_api.get(f"/api/tasks/{task.public_id}").json()["question_fields"] == []


# --- the thread's task list --------------------------------------------------------------------


def test_the_threads_task_list_honours_limit_keeping_active_tasks_first(acme, alice, alice_api):
    thread = Thread.objects.create(tenant=acme, owner=alice, title="t")
    for n in range(3):
        make_task(acme, alice, thread=thread, name=f"old {n}", status=TaskStatus.SUCCEEDED)
    running = make_task(acme, alice, thread=thread, name="running", status=TaskStatus.RUNNING, tracking_degraded=True)
    make_task(acme, alice, thread=thread, name="stopping", status=TaskStatus.RUNNING,
              cancel_requested_at=running.created_at)
    body = alice_api.get(f"/api/threads/{thread.public_id}/tasks?limit=3").json()
    assert [t["name"] for t in body["results"]] == ["stopping", "running", "old 2"]
    assert body["active"] == 2
    rows = {t["name"]: t for t in body["results"]}
    assert rows["running"]["tracking_degraded"] is True and rows["running"]["cancel_requested"] is False
    assert rows["stopping"]["cancel_requested"] is True and rows["stopping"]["tracking_degraded"] is False


def test_the_threads_task_list_refuses_a_bad_limit(acme, alice, alice_api):
    thread = Thread.objects.create(tenant=acme, owner=alice, title="t")
    for bad in ("0", "201", "many"):
        response = alice_api.get(f"/api/threads/{thread.public_id}/tasks?limit={bad}")
        assert response.status_code == 400 and response.json()["field"] == "limit"


def test_the_panel_row_carries_the_questions_fields_and_cancel_attempts(servers_file, acme, alice, alice_api):
    thread = Thread.objects.create(tenant=acme, owner=alice, title="t")
    asking(acme, alice, thread=thread, remote_cancel_attempts=2, remote_cancel_error="timed out")
    row = alice_api.get(f"/api/threads/{thread.public_id}/tasks").json()["results"][0]
    assert sorted(f["name"] for f in row["question_fields"]) == ["copies", "format", "title", "urgent"]
    assert row["cancel_attempts"] == 2 and row["cancel_error"] == "timed out"


# --- answering ---------------------------------------------------------------------------------


def test_a_structured_answer_is_checked_coerced_and_stored(servers_file, acme, alice, alice_api):
    task = asking(acme, alice)
    answer = {"action": "accept", "content": {"title": "Q3", "copies": "2", "urgent": True, "format": "pdf"}}
    response = alice_api.post(f"/api/tasks/{task.public_id}/answer", {"answer": answer}, format="json")
    assert response.status_code == 202, response.content
    task.refresh_from_db()
    assert task.status != TaskStatus.WAITING_INPUT  # queued, and admitted at once
    assert task.answer_data == {"action": "accept", "content": {"title": "Q3", "copies": 2, "urgent": True,
                                                                "format": "pdf"}}


@pytest.mark.parametrize(("content", "field"), [
    ({"title": "Q3", "copies": 11, "format": "pdf"}, "answer.content.copies"),
    ({"title": "Q3", "copies": 1.5, "format": "pdf"}, "answer.content.copies"),
    ({"title": "Q3", "copies": 2, "format": "docx"}, "answer.content.format"),
    ({"copies": 2, "format": "pdf"}, "answer.content.title"),
    ({"title": "Q3", "copies": 2, "format": "pdf", "colour": "red"}, "answer.content.colour"),
])
def test_an_answer_that_does_not_fit_the_form_is_refused_naming_the_field(
        servers_file, acme, alice, alice_api, content, field):
    task = asking(acme, alice)
    response = alice_api.post(f"/api/tasks/{task.public_id}/answer",
                              {"answer": {"action": "accept", "content": content}}, format="json")
    assert response.status_code == 400, response.content
    assert response.json()["code"] == "invalid_input" and response.json()["field"] == field
    task.refresh_from_db()
    assert task.status == TaskStatus.WAITING_INPUT and task.answer_data is None and task.answer == ""
    assert not AuditEntry.objects.filter(action="task.answer").exists()


@pytest.mark.parametrize("action", ["decline", "cancel"])
def test_decline_and_cancel_are_answers_too(servers_file, acme, alice, alice_api, action):
    task = asking(acme, alice)
    response = alice_api.post(f"/api/tasks/{task.public_id}/answer", {"answer": {"action": action}}, format="json")
    assert response.status_code == 202, response.content
    task.refresh_from_db()
    assert task.answer_data == {"action": action} and task.status != TaskStatus.WAITING_INPUT


def test_text_cannot_answer_a_form_of_several_fields(servers_file, acme, alice, alice_api):
    task = asking(acme, alice)
    response = alice_api.post(f"/api/tasks/{task.public_id}/answer", {"answer": "pdf please"}, format="json")
    assert response.status_code == 400 and response.json()["field"] == "answer"
    task.refresh_from_db()
    assert task.status == TaskStatus.WAITING_INPUT


def test_text_answers_a_form_of_one_text_field(servers_file, acme, alice, alice_api):
    task = asking(acme, alice, form={"type": "object", "properties": {"format": {"type": "string"}},
                                     "required": ["format"]})
    response = alice_api.post(f"/api/tasks/{task.public_id}/answer", {"answer": " pdf "}, format="json")
    assert response.status_code == 202
    task.refresh_from_db()
    assert task.answer == "pdf" and task.answer_data is None and task.status != TaskStatus.WAITING_INPUT


def test_a_structured_answer_over_10000_characters_is_refused_naming_the_answer(servers_file, acme, alice,
                                                                                   alice_api):
    task = asking(acme, alice, form={"type": "object", "properties": {"summary": {"type": "string"},
                                                                      "details": {"type": "string"}}})
    content = {"summary": "s" * 6_000, "details": "d" * 6_000}  # each field fits; together they do not
    response = alice_api.post(f"/api/tasks/{task.public_id}/answer",
                              {"answer": {"action": "accept", "content": content}}, format="json")
    assert response.status_code == 400, response.content
    assert response.json()["field"] == "answer" and "10000 characters" in response.json()["error"]
    task.refresh_from_db()
    assert task.status == TaskStatus.WAITING_INPUT and task.answer_data is None


@pytest.mark.parametrize("body", [{"answer": {"action": "maybe"}}, {"answer": ["pdf"]}, {"answer": 5},
                                  {"answer": "   "}, {}])
def test_a_malformed_answer_is_a_400(servers_file, acme, alice, alice_api, body):
    task = asking(acme, alice)
    response = alice_api.post(f"/api/tasks/{task.public_id}/answer", body, format="json")
    assert response.status_code == 400 and response.json()["field"] == "answer"


def test_a_local_tasks_question_takes_text_only(acme, alice, alice_api):
    task = make_task(acme, alice, status=TaskStatus.WAITING_INPUT, question="Which quarter?")
    response = alice_api.post(f"/api/tasks/{task.public_id}/answer", {"answer": {"action": "decline"}},
                              format="json")
    assert response.status_code == 400 and response.json()["field"] == "answer"


# --- no server internals ------------------------------------------------------------------------


def test_no_answer_names_the_configured_server_or_the_remote_handle(servers_file, acme, alice, alice_api):
    thread = Thread.objects.create(tenant=acme, owner=alice, title="t")
    task = asking(acme, alice, thread=thread)
    TaskEvent.objects.create(task=task, tenant=acme, seq=1, kind="remote_started", status=TaskStatus.RUNNING,
                             data={"tool": "build_report", "server": "reports-internal"}, at=task.created_at)
    Task.objects.filter(pk=task.pk).update(last_event_seq=1)
    detail = alice_api.get(f"/api/tasks/{task.public_id}")
    assert detail.json()["input"] == {"server": "Report Studio", "tool": "build_report",
                                      "arguments": {"quarter": "Q3"}}
    events = alice_api.get(f"/api/tasks/{task.public_id}/events")
    assert events.json()["results"][0]["data"] == {"tool": "build_report", "server": "Report Studio"}
    answers = [detail, events, alice_api.get("/api/tasks"), alice_api.get(f"/api/threads/{thread.public_id}/tasks"),
               alice_api.get(f"/api/threads/{thread.public_id}/messages")]
    for response in answers:
        assert response.status_code == 200
        assert "reports-internal" not in response.content.decode() and HANDLE not in response.content.decode()


def test_a_server_no_longer_configured_is_not_named_at_all(servers_file, acme, alice, alice_api, settings):
    task = remote_task(acme, alice, input={"server": "gone-server", "tool": "t", "arguments": {}})
    body = alice_api.get(f"/api/tasks/{task.public_id}").json()
    assert body["input"] == {"tool": "t", "arguments": {}}


def test_other_users_cannot_answer(servers_file, acme, alice, bob):
    task = asking(acme, alice)
    response = api_client_for(bob).post(f"/api/tasks/{task.public_id}/answer", {"answer": {"action": "decline"}},
                                        format="json")
    assert response.status_code == 404
    assert not Message.objects.exists()
