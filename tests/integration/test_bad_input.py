"""Bad input and abuse on the REST API: each refused with a 4xx naming the problem, nothing written.

Complements test_api_tasks.py (field-by-field submission errors) and test_api_fuzz.py (schema-driven
fuzzing): here are the inputs a generator does not produce on its own, such as huge and deeply nested
bodies, wrong content types and every path with an id that is not a UUID.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from rest_framework.test import APIClient

from chat.models import Message, Run, Thread
from tasks.models import AuditEntry, IdempotencyRecord, Task, TaskEvent
from tests.factories import make_task

pytestmark = pytest.mark.django_db
SLEEP = {"kind": "sleep", "name": "nap", "input": {"steps": 2}}

TASK_VERBS = [("get", ""), ("get", "/events"), ("get", "/result"), ("post", "/cancel"), ("post", "/pause"),
              ("post", "/resume"), ("post", "/answer")]
THREAD_VERBS = [("get", ""), ("patch", ""), ("delete", ""), ("get", "/messages"), ("post", "/messages"),
                ("get", "/tasks")]
NOT_UUIDS = ["not-a-uuid", "123", "00000000-0000-0000-0000-00000000000g", "%00", "x" * 2000,
             "847d9539-c35f-4caf-adf7-953ac9d56ee4extra"]  # fixed: parallel runs must collect the same names


def counts() -> dict[str, int]:
    return {model.__name__: model.objects.count()
            for model in (Task, TaskEvent, IdempotencyRecord, AuditEntry, Thread, Message, Run)}


@pytest.fixture
def nothing_written() -> Iterator[None]:
    """Asserts, after the test, that no row was added or removed anywhere a request could write."""
    before = counts()
    yield
    assert counts() == before


@pytest.fixture
def task(acme, alice) -> Task:
    return make_task(acme, alice, status="waiting_input", question="Which year?")


@pytest.fixture
def thread(acme, alice) -> Thread:
    return Thread.objects.create(tenant=acme, owner=alice, title="Research")


def assert_error(response: Any, status: int, code: str, field: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, response.content[:500]
    body = response.json()
    assert set(body) <= {"error", "code", "field"}, body
    assert body["code"] == code, body
    assert body["error"]
    if field is not None:
        assert body.get("field") == field, body
    return body


def raw_post(client: APIClient, path: str, body: bytes | str, content_type: str = "application/json") -> Any:
    return client.generic("POST", path, body, content_type=content_type)


def nested(depth: int) -> str:
    return '{"a":' * depth + "1" + "}" * depth


# --- ids in paths -----------------------------------------------------------------

@pytest.mark.parametrize("bad_id", NOT_UUIDS)
def test_every_task_path_answers_404_for_an_id_that_is_not_a_uuid(alice_api, task, bad_id, nothing_written):
    for method, suffix in TASK_VERBS:
        response = getattr(alice_api, method)(f"/api/tasks/{bad_id}{suffix}", {}, format="json")
        assert_error(response, 404, "not_found")
    assert Task.objects.get().status == "waiting_input"


@pytest.mark.parametrize("bad_id", NOT_UUIDS)
def test_every_thread_path_answers_404_for_an_id_that_is_not_a_uuid(alice_api, thread, bad_id, nothing_written):
    for method, suffix in THREAD_VERBS:
        response = getattr(alice_api, method)(f"/api/threads/{bad_id}{suffix}", {"content": "hi", "title": "x"},
                                              format="json")
        assert_error(response, 404, "not_found")
    assert Thread.objects.get().title == "Research"


def test_a_thread_filter_that_is_not_a_uuid_is_a_400(alice_api):
    assert_error(alice_api.get("/api/tasks?thread=nope"), 400, "invalid_input", "thread")
    assert_error(alice_api.get("/api/tasks?thread="), 400, "invalid_input", "thread")


# --- query parameters -------------------------------------------------------------

@pytest.mark.parametrize("query", ["limit=abc", "limit=0", "limit=201", "limit=", "limit=1.5"])
def test_a_bad_page_size_on_the_task_list_is_a_400(alice_api, query):
    assert_error(alice_api.get(f"/api/tasks?{query}"), 400, "invalid_input", "limit")


def test_a_cursor_the_api_did_not_hand_out_is_a_400(alice_api):
    assert_error(alice_api.get("/api/tasks?cursor=forged"), 400, "invalid_input", "cursor")


@pytest.mark.parametrize("query", ["after=x", "after=-1", f"after={2**63}", "limit=0", "limit=1001", "after="])
def test_bad_event_paging_is_a_400(alice_api, task, query):
    field = query.split("=")[0]
    assert_error(alice_api.get(f"/api/tasks/{task.public_id}/events?{query}"), 400, "invalid_input", field)


@pytest.mark.parametrize("query", ["after=x", "limit=501", "limit=-3"])
def test_bad_message_paging_is_a_400(alice_api, thread, query):
    field = query.split("=")[0]
    assert_error(alice_api.get(f"/api/threads/{thread.public_id}/messages?{query}"), 400, "invalid_input", field)


def test_an_empty_status_filter_is_a_400_not_no_filter(alice_api):
    assert_error(alice_api.get("/api/tasks?status="), 400, "invalid_input", "status")


# --- budgets, kinds, priorities ---------------------------------------------------

@pytest.mark.parametrize(
    ("budget", "field"),
    [
        ({"max_steps": 0}, "budget.max_steps"),
        ({"max_wall_seconds": -5}, "budget.max_wall_seconds"),
        ({"max_tokens": 10**30}, "budget.max_tokens"),
        ({"max_steps": 2**63}, "budget.max_steps"),
        ({"max_steps": "10"}, "budget.max_steps"),
        ({"max_steps": 10.5}, "budget.max_steps"),
        ({"max_steps": True}, "budget.max_steps"),
        ({"max_steps": None}, "budget.max_steps"),
        ({"max_bananas": 3}, "budget.max_bananas"),
        ([1, 2], "budget"),
        ("lots", "budget"),
        (7, "budget"),
    ],
)
def test_a_bad_budget_is_a_400_naming_it(alice_api, budget, field, nothing_written):
    response = alice_api.post("/api/tasks", {**SLEEP, "budget": budget}, format="json")
    assert_error(response, 400, "invalid_input", field)


@pytest.mark.parametrize("budget", [{"max_steps": -1}, {"max_retries": 10**12}, {"max_steps": "many"}, "x"])
def test_resuming_with_a_bad_budget_is_a_400_and_leaves_the_task_paused(alice_api, acme, alice, budget):
    task = make_task(acme, alice, status="paused")
    before = counts()
    response = alice_api.post(f"/api/tasks/{task.public_id}/resume", {"budget": budget}, format="json")
    assert_error(response, 400, "invalid_input")
    assert response.json()["field"].startswith("budget")
    assert counts() == before
    task.refresh_from_db()
    assert task.status == "paused" and task.budget == {}


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({**SLEEP, "kind": "rm -rf"}, "kind"),
        ({**SLEEP, "kind": ""}, "kind"),
        ({**SLEEP, "kind": 7}, "kind"),
        ({**SLEEP, "kind": None}, "kind"),
        ({**SLEEP, "kind": ["sleep"]}, "kind"),
        ({**SLEEP, "kind": "k" * 33}, "kind"),
        ({**SLEEP, "priority": "5"}, "priority"),
        ({**SLEEP, "priority": 1.5}, "priority"),
        ({**SLEEP, "priority": -11}, "priority"),
        ({**SLEEP, "priority": 10**20}, "priority"),
        ({**SLEEP, "name": 12}, "name"),
        ({**SLEEP, "name": "nul\x00byte"}, None),
        ({**SLEEP, "input": {"steps": "2"}}, "input.steps"),
        ({**SLEEP, "input": {"steps": 10**20}}, "input.steps"),
        ({**SLEEP, "input": None}, "input"),
        ({**SLEEP, "thread": 12345}, "thread"),
    ],
)
def test_a_bad_submission_is_a_400_naming_the_field(alice_api, body, field, nothing_written):
    response = alice_api.post("/api/tasks", body, format="json", HTTP_IDEMPOTENCY_KEY="k1")
    assert_error(response, 400, "invalid_input", field)


def test_a_nul_character_anywhere_in_the_body_is_refused(alice_api, thread, nothing_written):
    # PostgreSQL can store NUL neither in text nor in jsonb; unrefused, it is a 500 at INSERT.
    research = {"kind": "research", "input": {"question": "What is \x00 in jsonb?"}}
    assert_error(alice_api.post("/api/tasks", research, format="json"), 400, "invalid_input")
    assert_error(alice_api.post("/api/tasks", {**SLEEP, "input": {"st\x00eps": 2}}, format="json"),
                 400, "invalid_input")
    assert_error(alice_api.post(f"/api/threads/{thread.public_id}/messages", {"content": "a\x00b"}, format="json"),
                 400, "invalid_input")


def test_text_that_is_only_whitespace_is_not_a_message(alice_api, thread, nothing_written):
    response = alice_api.post(f"/api/threads/{thread.public_id}/messages", {"content": " \n\t "}, format="json")
    assert_error(response, 400, "invalid_input", "content")


@pytest.mark.parametrize("body", [{"answer": 42}, {"answer": "   "}, {"answer": "x" * 10_001}, {}])
def test_a_bad_answer_is_a_400_and_the_task_still_waits(alice_api, task, body, nothing_written):
    assert_error(alice_api.post(f"/api/tasks/{task.public_id}/answer", body, format="json"),
                 400, "invalid_input", "answer")
    assert Task.objects.get().status == "waiting_input"


@pytest.mark.parametrize("body", [{"keep_results": "yes"}, {"keep_results": 1}, {"reason": 5},
                                  {"reason": "r" * 501}])
def test_a_bad_cancel_body_is_a_400_and_cancels_nothing(alice_api, task, body, nothing_written):
    assert_error(alice_api.post(f"/api/tasks/{task.public_id}/cancel", body, format="json"), 400, "invalid_input")
    assert Task.objects.get().cancel_requested_at is None


def test_a_thread_title_must_be_text(alice_api, thread, nothing_written):
    assert_error(alice_api.post("/api/threads", {"title": 3.5}, format="json"), 400, "invalid_input", "title")
    assert_error(alice_api.patch(f"/api/threads/{thread.public_id}", {"title": False}, format="json"),
                 400, "invalid_input", "title")
    assert Thread.objects.get().title == "Research"


# --- bodies that are not what JSON endpoints take --------------------------------

def write_endpoints(task: Task, thread: Thread) -> list[tuple[str, str]]:
    return [("post", "/api/tasks"), ("post", f"/api/tasks/{task.public_id}/cancel"),
            ("post", f"/api/tasks/{task.public_id}/answer"), ("post", f"/api/tasks/{task.public_id}/resume"),
            ("post", "/api/threads"), ("patch", f"/api/threads/{thread.public_id}"),
            ("post", f"/api/threads/{thread.public_id}/messages")]


@pytest.mark.parametrize(
    ("body", "code"),
    [
        ("{not json", "malformed_json"),
        ('{"kind": "sleep",}', "malformed_json"),
        ('{"kind": NaN}', "malformed_json"),
        ('{"budget": {"max_steps": Infinity}}', "malformed_json"),
        # Too large for a double: Python reads inf, which jsonb cannot store.
        ('{"kind": "sleep", "input": {"seconds": 1e999}}', "malformed_json"),
        ('{"reason": "x", "weight": -1E+999}', "malformed_json"),
        (b"\xff\xfe{\x00}", "malformed_json"),
        ("[1, 2, 3]", "invalid_input"),
        ('"just a string"', "invalid_input"),
        ("42", "invalid_input"),
        ("null", "invalid_input"),
    ],
)
def test_a_body_that_is_not_a_json_object_is_a_400_everywhere(alice_api, task, thread, body, code,
                                                               nothing_written):
    for method, path in write_endpoints(task, thread):
        response = alice_api.generic(method.upper(), path, body, content_type="application/json")
        assert_error(response, 400, code)
    assert Task.objects.get().status == "waiting_input"


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", "application/xml"])
def test_a_body_that_is_not_json_is_refused_with_415(alice_api, task, thread, content_type, nothing_written):
    for method, path in write_endpoints(task, thread):
        response = alice_api.generic(method.upper(), path, "kind=sleep", content_type=content_type)
        body = assert_error(response, 415, "unsupported_media_type")
        assert content_type.split(";")[0] in body["error"]


# --- size and depth ----------------------------------------------------------------

def test_a_body_over_the_size_limit_is_refused_with_413(alice_api, thread, settings, nothing_written):
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 10_000
    big = json.dumps({**SLEEP, "name": "x" * 20_000})
    body = assert_error(raw_post(alice_api, "/api/tasks", big), 413, "body_too_large")
    assert "10000 bytes" in body["error"]
    assert_error(raw_post(alice_api, f"/api/threads/{thread.public_id}/messages",
                          json.dumps({"content": "y" * 20_000})), 413, "body_too_large")


def test_the_default_size_limit_refuses_a_body_of_a_few_megabytes(alice_api, settings, nothing_written):
    assert settings.DATA_UPLOAD_MAX_MEMORY_SIZE == 1_000_000
    huge = json.dumps({**SLEEP, "input": {"steps": 2, "pad": "z" * 3_000_000}})
    assert_error(raw_post(alice_api, "/api/tasks", huge), 413, "body_too_large")


def test_a_body_just_under_the_limit_is_read(alice_api, settings, nothing_written):
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 10_000
    response = raw_post(alice_api, "/api/tasks", json.dumps({**SLEEP, "name": "x" * 300}))
    assert_error(response, 400, "invalid_input", "name")  # parsed: refused for the name, not the size


@pytest.mark.parametrize("depth", [65, 500, 990, 10_000, 100_000])
def test_deeply_nested_json_is_a_400_not_a_recursion_error(alice_api, thread, depth, nothing_written):
    body = assert_error(raw_post(alice_api, "/api/tasks", f'{{"kind": "sleep", "input": {nested(depth)}}}'),
                        400, "json_too_deep")
    assert "64 levels" in body["error"]
    assert_error(raw_post(alice_api, f"/api/threads/{thread.public_id}/messages", "[" * depth + "]" * depth),
                 400, "json_too_deep")


def test_nesting_within_the_limit_reaches_validation(alice_api, nothing_written):
    response = raw_post(alice_api, "/api/tasks", f'{{"kind": "sleep", "input": {{"steps": {nested(60)}}}}}')
    assert_error(response, 400, "invalid_input", "input.steps")


def test_an_empty_body_is_a_missing_field_not_a_crash(alice_api, nothing_written):
    assert_error(raw_post(alice_api, "/api/tasks", ""), 400, "invalid_input", "kind")

