"""Threads, messages and runs over the API; the chat agent's background-task tools."""

from __future__ import annotations

import uuid

import pytest

from chat.models import Message, Run, Thread
from tasks.models import Task
from tasks.statuses import TaskStatus
from tests.integration.chatting import run_queued

pytestmark = pytest.mark.django_db


def new_thread(client, title: str = "") -> str:
    response = client.post("/api/threads", {"title": title}, format="json")
    assert response.status_code == 201
    return response.json()["id"]


def say(client, thread_id: str, text: str, key: str | None = None):
    headers = {"HTTP_IDEMPOTENCY_KEY": key} if key else {}
    return client.post(f"/api/threads/{thread_id}/messages", {"content": text}, format="json", **headers)


def visible(client, thread_id: str) -> list[tuple[str, str]]:
    body = client.get(f"/api/threads/{thread_id}/messages").json()
    return [(m["role"], m["content"]) for m in body["results"]]


@pytest.mark.smoke
def test_it_creates_lists_renames_and_deletes_threads(alice_api):
    thread_id = new_thread(alice_api, "Plans")
    assert [t["title"] for t in alice_api.get("/api/threads").json()["results"]] == ["Plans"]
    renamed = alice_api.patch(f"/api/threads/{thread_id}", {"title": "Better plans"}, format="json")
    assert renamed.json()["title"] == "Better plans"
    assert alice_api.delete(f"/api/threads/{thread_id}").status_code == 204
    assert alice_api.get("/api/threads").json()["results"] == []
    assert alice_api.get(f"/api/threads/{thread_id}").status_code == 404
    assert not Thread.objects.filter(public_id=thread_id).exists(), "a deleted thread is gone, not marked"


def test_another_tenants_thread_is_a_404_on_every_verb(alice_api, charlie_api):
    thread_id = new_thread(alice_api)
    for response in (
        charlie_api.get(f"/api/threads/{thread_id}"),
        charlie_api.patch(f"/api/threads/{thread_id}", {"title": "x"}, format="json"),
        charlie_api.delete(f"/api/threads/{thread_id}"),
        charlie_api.get(f"/api/threads/{thread_id}/messages"),
        say(charlie_api, thread_id, "hello"),
        charlie_api.get(f"/api/threads/{thread_id}/tasks"),
    ):
        assert response.status_code == 404
        assert response.json()["code"] == "not_found"
    assert not Message.objects.exists()
    assert Thread.objects.filter(public_id=thread_id).exists()


def test_a_message_starts_a_run_that_stores_one_reply(alice_api):
    thread_id = new_thread(alice_api)
    response = say(alice_api, thread_id, "hello there")
    assert response.status_code == 202
    assert response.json()["status"] == "pending"
    run_queued()
    messages = visible(alice_api, thread_id)
    assert messages[0] == ("user", "hello there")
    assert messages[1][0] == "assistant" and "background" in messages[1][1]
    assert Run.objects.get().status == Run.Status.SUCCEEDED


def test_a_busy_thread_refuses_a_second_run(alice_api):
    thread_id = new_thread(alice_api)
    say(alice_api, thread_id, "first")
    second = say(alice_api, thread_id, "second")
    assert second.status_code == 409
    assert second.json()["code"] == "thread_busy"
    assert [m.content for m in Message.objects.all()].count("second") == 0  # sealed: read, not queried


def test_the_same_idempotency_key_returns_the_same_run(alice_api):
    thread_id = new_thread(alice_api)
    first = say(alice_api, thread_id, "hello", key="m-1")
    again = say(alice_api, thread_id, "hello", key="m-1")
    assert first.status_code == 202 and again.status_code == 200
    assert first.json()["id"] == again.json()["id"]
    assert Message.objects.filter(role="user").count() == 1


def test_a_deleted_thread_takes_no_new_message(alice_api):
    thread_id = new_thread(alice_api)
    alice_api.delete(f"/api/threads/{thread_id}")
    assert say(alice_api, thread_id, "hello").status_code == 404
    assert not Run.objects.exists()


def test_asking_for_research_starts_a_background_task_in_the_thread(alice_api):
    thread_id = new_thread(alice_api)
    say(alice_api, thread_id, "research how asyncio cancellation works")
    run_queued()
    task = Task.objects.get()
    assert task.kind == "research"
    assert task.thread.public_id == uuid.UUID(thread_id)
    assert task.input["question"] == "how asyncio cancellation works"
    reply = visible(alice_api, thread_id)[-1][1]
    assert "asyncio cancellation" in reply
    assert str(task.public_id) not in reply, "no task id is shown to the user"
    panel = alice_api.get(f"/api/threads/{thread_id}/tasks").json()
    assert panel["active"] == 1
    assert panel["results"][0]["name"] == task.name


def test_it_lists_cancels_by_name_and_refuses_ambiguous_names(alice_api):
    thread_id = new_thread(alice_api)
    for topic in ("asyncio cancellation", "asyncio timeouts", "json parsing"):
        say(alice_api, thread_id, f"research {topic}")
        run_queued()
    say(alice_api, thread_id, "what is running?")
    run_queued()
    listing = visible(alice_api, thread_id)[-1][1]
    assert "Research: asyncio cancellation" in listing and "Research: json parsing" in listing
    say(alice_api, thread_id, "cancel the asyncio research")
    run_queued()
    ambiguous = visible(alice_api, thread_id)[-1][1]
    assert "More than one task matches" in ambiguous
    assert "Research: asyncio timeouts" in ambiguous
    assert not Task.objects.filter(status=TaskStatus.CANCELLED).exists()
    for task in Task.objects.all():
        assert str(task.public_id) not in ambiguous
    say(alice_api, thread_id, "cancel the json research")
    run_queued()
    assert Task.objects.get(name="Research: json parsing").status == TaskStatus.CANCELLED
    assert Task.objects.filter(status=TaskStatus.CANCELLED).count() == 1


def test_an_unknown_name_lists_the_candidates(alice_api):
    thread_id = new_thread(alice_api)
    say(alice_api, thread_id, "research python decorators")
    run_queued()
    say(alice_api, thread_id, "cancel the rust research")
    run_queued()
    reply = visible(alice_api, thread_id)[-1][1]
    assert "No task matches" in reply and "Research: python decorators" in reply


def test_answer_resumes_a_task_waiting_for_input_and_409s_otherwise(alice_api, acme, alice, settings):
    from tasks import jobs
    from tests.factories import submit_sleep

    settings.LONGHAUL_STEP_SLICE_MS = 0
    task = submit_sleep(acme, alice, steps=2, ask_at_step=1, question="Which colour?")
    jobs.advance(task.pk)
    task.refresh_from_db()
    assert task.status == TaskStatus.WAITING_INPUT
    assert alice_api.get(f"/api/tasks/{task.public_id}").json()["question"] == "Which colour?"
    answered = alice_api.post(f"/api/tasks/{task.public_id}/answer", {"answer": "blue"}, format="json")
    assert answered.status_code == 202
    assert answered.json()["status"] == "running", "admitted again at once"
    again = alice_api.post(f"/api/tasks/{task.public_id}/answer", {"answer": "red"}, format="json")
    assert again.status_code == 409 and again.json()["code"] == "not_waiting"
    jobs.advance(task.pk)
    jobs.advance(task.pk)
    task.refresh_from_db()
    assert task.status == TaskStatus.SUCCEEDED
    assert "You answered: blue" in task.result["summary"]
