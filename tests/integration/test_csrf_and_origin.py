"""Cross-site requests: session-authenticated API writes need the CSRF token; WebSockets need our origin.

Token-authenticated calls carry no ambient credential, so they need no CSRF token.
"""

from __future__ import annotations

from typing import Any

import pytest
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator
from django.test import Client

from chat.models import Message, Run, Thread
from project.asgi import application
from tasks.models import AuditEntry, IdempotencyRecord, Task
from tests.factories import make_task
from tests.integration.test_stream import _close_consumer_connections, _stream_settings, session_cookie  # noqa: F401

SLEEP = {"kind": "sleep", "name": "nap", "input": {"steps": 2}}


def counts() -> dict[str, int]:
    return {model.__name__: model.objects.count() for model in (Task, IdempotencyRecord, AuditEntry, Thread,
                                                                  Message, Run)}


def browser_for(user: Any) -> tuple[Client, str]:
    """A signed-in browser that checks CSRF as a real one is checked, and the token the chat page gave it."""
    browser = Client(enforce_csrf_checks=True)
    browser.force_login(user)
    assert browser.get("/").status_code == 200
    return browser, browser.cookies["csrftoken"].value


def assert_csrf_refused(response: Any) -> None:
    assert response.status_code == 403, response.content
    body = response.json()
    assert body["code"] == "permission_denied"
    assert "CSRF" in body["error"]
    assert set(body) <= {"error", "code", "field"}


@pytest.mark.django_db
def test_a_session_post_without_the_csrf_token_is_refused_and_writes_nothing(alice):
    browser, _ = browser_for(alice)
    before = counts()
    assert_csrf_refused(browser.post("/api/tasks", SLEEP, content_type="application/json"))
    assert_csrf_refused(browser.post("/api/threads", {"title": "x"}, content_type="application/json"))
    assert counts() == before


@pytest.mark.django_db
def test_a_session_post_with_a_wrong_csrf_token_is_refused(alice):
    browser, token = browser_for(alice)
    wrong = ("b" if token[0] == "a" else "a") + token[1:]
    response = browser.post("/api/tasks", SLEEP, content_type="application/json", HTTP_X_CSRFTOKEN=wrong)
    assert_csrf_refused(response)
    assert not Task.objects.exists()


@pytest.mark.django_db
def test_a_session_post_with_the_csrf_token_is_accepted(alice):
    browser, token = browser_for(alice)
    response = browser.post("/api/tasks", SLEEP, content_type="application/json", HTTP_X_CSRFTOKEN=token)
    assert response.status_code == 201, response.content
    assert Task.objects.get().owner == alice


@pytest.mark.django_db
def test_every_session_write_on_a_thread_or_task_needs_the_token(acme, alice):
    thread = Thread.objects.create(tenant=acme, owner=alice, title="Research")
    task = make_task(acme, alice, status="running")
    browser, token = browser_for(alice)
    writes = [
        ("post", f"/api/threads/{thread.public_id}/messages", {"content": "hello"}),
        ("patch", f"/api/threads/{thread.public_id}", {"title": "renamed"}),
        ("delete", f"/api/threads/{thread.public_id}", None),
        ("post", f"/api/tasks/{task.public_id}/cancel", {}),
        ("post", f"/api/tasks/{task.public_id}/pause", {}),
    ]
    before = counts()
    for method, path, body in writes:
        assert_csrf_refused(getattr(browser, method)(path, body, content_type="application/json"))
    assert counts() == before
    thread.refresh_from_db()
    task.refresh_from_db()
    assert thread.title == "Research"
    assert task.cancel_requested_at is None and task.pause_requested_at is None
    renamed = browser.patch(f"/api/threads/{thread.public_id}", {"title": "renamed"},
                            content_type="application/json", HTTP_X_CSRFTOKEN=token)
    assert renamed.status_code == 200 and renamed.json()["title"] == "renamed"


@pytest.mark.django_db
def test_session_reads_need_no_token(alice):
    browser, _ = browser_for(alice)
    assert browser.get("/api/tasks").status_code == 200


@pytest.mark.django_db
def test_a_token_authenticated_write_needs_no_csrf_token(alice_api):
    response = alice_api.post("/api/tasks", SLEEP, format="json")
    assert response.status_code == 201


@pytest.mark.django_db
def test_the_sign_in_form_needs_the_csrf_token(alice):
    browser = Client(enforce_csrf_checks=True)
    response = browser.post("/accounts/login/", {"username": "alice", "password": "alice-password-1"})
    assert response.status_code == 403
    assert "_auth_user_id" not in browser.session


# --- WebSocket origin ----------------------------------------------------------------

@pytest.fixture
def stream_paths(acme, alice) -> dict[str, str]:
    task = make_task(acme, alice, status="succeeded")
    thread = Thread.objects.create(tenant=acme, owner=alice, title="Research")
    return {"task": f"/ws/tasks/{task.public_id}/?after=0", "thread": f"/ws/threads/{thread.public_id}/?after=0"}


async def handshake(path: str, headers: list[tuple[bytes, bytes]]) -> bool:
    comm = WebsocketCommunicator(application, path, headers=headers)
    accepted, _ = await comm.connect(timeout=5)
    await comm.disconnect()
    return accepted


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("stream", ["task", "thread"])
@pytest.mark.parametrize("origin", [b"http://evil.example", b"http://127.0.0.1.evil.example", b"null", None])
async def test_a_websocket_from_another_origin_or_none_is_refused(stream_paths, alice, stream, origin):
    cookie = await database_sync_to_async(session_cookie)(alice)
    headers = [(b"cookie", cookie)] + ([(b"origin", origin)] if origin is not None else [])
    assert not await handshake(stream_paths[stream], headers)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("stream", ["task", "thread"])
async def test_a_websocket_from_our_own_origin_is_accepted(stream_paths, alice, stream):
    cookie = await database_sync_to_async(session_cookie)(alice)
    assert await handshake(stream_paths[stream], [(b"cookie", cookie), (b"origin", b"http://127.0.0.1")])
