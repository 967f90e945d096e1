"""A dropped connection mid-task: the page says it is reconnecting, resumes from what it
last saw, and ends with every message and event exactly once."""

from __future__ import annotations

import re
from urllib.parse import parse_qs, urlparse

import pytest
from playwright.sync_api import Page, WebSocketRoute, expect

from chat.models import Message
from tasks.models import Task, Tenant
from tests.conftest import make_user
from tests.e2e.chat_page import (
    api_event_seqs, api_message_ids, assistant_messages, open_panel, rendered_message_ids, send, sign_in_with_cookie,
    stored_message_ids, task_row, thread_id_of, wait_until,
)

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

TASK = "Test task (6 steps)"


class Network:
    """Sits between the page and daphne's WebSockets; can drop every connection and refuse new ones."""

    def __init__(self) -> None:
        self.connected: list[WebSocketRoute] = []
        self.opened: list[str] = []  # URLs the page opened, in order
        self.refusing = False

    def route(self, ws: WebSocketRoute) -> None:
        self.opened.append(ws.url)
        if self.refusing:
            ws.close(code=1001, reason="network down")
            return
        ws.connect_to_server()
        self.connected.append(ws)

    def drop(self) -> None:
        """Cut every open connection, as a lost network or a restarted server would."""
        self.refusing = True
        for ws in self.connected:
            ws.close(code=1001, reason="network down")
        self.connected.clear()

    def restore(self) -> None:
        self.refusing = False

    def task_stream_cursors(self, task_id: str) -> list[int]:
        return [int(parse_qs(urlparse(url).query)["after"][0]) for url in self.opened if f"/ws/tasks/{task_id}/" in url]


def test_it_resumes_after_a_dropped_connection_with_nothing_missing_or_repeated(page: Page, server: str,
                                                                               cheap_passwords):
    erin = make_user("erin", Tenant.objects.create(slug="acme", name="Acme"))
    network = Network()
    page.route_web_socket(re.compile(r"/ws/"), network.route)
    sign_in_with_cookie(page, server, erin)
    page.goto(f"{server}/")
    send(page, "run a test task of 6 steps")
    expect(assistant_messages(page, TASK)).to_have_count(1, timeout=10_000)
    thread_id = thread_id_of(page)
    task = Task.objects.get(thread__public_id=thread_id)

    open_panel(page)
    row = task_row(page, TASK)
    row.get_by_role("button", name=TASK, exact=True).click()
    timeline = row.locator(".timeline")
    expect(timeline).to_contain_text("Step 2 of 6 done", timeout=10_000)
    expect(page.locator("#connection")).to_be_hidden()

    network.drop()
    seen_before_drop = max(int(s) for s in timeline.locator("li").evaluate_all("els => els.map(e => e.dataset.seq)"))
    expect(page.locator("#connection")).to_be_visible()
    expect(page.locator("#connection")).to_contain_text("Reconnecting")
    expect(row.locator(".live-label")).to_have_text("Reconnecting…")

    # While the page is cut off, the task goes on, and someone asks something in the thread.
    wait_until(lambda: task.events.filter(kind="step_done").count() >= 4, timeout=10, message="two more steps")
    reply = page.request.post(f"{server}/api/threads/{thread_id}/messages", data={"content": "what is running?"},
                              headers={"X-CSRFToken": next(c["value"] for c in page.context.cookies()
                                                           if c["name"] == "csrftoken"),
                                       "Idempotency-Key": "asked-while-offline"})
    assert reply.status == 202
    wait_until(lambda: any(m.content.startswith("Running now")  # content is sealed: read, not queried
                           for m in Message.objects.filter(thread__public_id=thread_id)),
               timeout=10, message="the assistant's answer")

    network.restore()
    expect(page.locator("#connection")).to_be_hidden(timeout=10_000)
    expect(assistant_messages(page, "Running now")).to_have_count(1, timeout=10_000)

    # The task stream came back from the last event the page had, not from the start.
    cursors = network.task_stream_cursors(str(task.public_id))
    assert cursors[0] == 0
    assert len(cursors) >= 2 and all(c >= seen_before_drop for c in cursors[1:]), cursors

    # Let the task finish and be told; then the page holds exactly what the server holds.
    expect(page.locator("#recent-tasks").locator(row)).to_have_count(1, timeout=15_000)
    expect(assistant_messages(page, f"{TASK} is done")).to_have_count(1, timeout=15_000)
    wait_until(lambda: rendered_message_ids(page) == api_message_ids(page, server, thread_id), timeout=10,
               message="the rendered messages to match GET /api/threads/<id>/messages")
    assert api_message_ids(page, server, thread_id) == stored_message_ids(thread_id)
    seqs = api_event_seqs(page, server, str(task.public_id))
    expect(timeline.locator("li")).to_have_count(len(seqs))
    rendered = [int(s) for s in timeline.locator("li").evaluate_all("els => els.map(e => e.dataset.seq)")]
    assert rendered == seqs == list(range(1, len(seqs) + 1))
    assert len(rendered_message_ids(page)) == len(set(rendered_message_ids(page)))
