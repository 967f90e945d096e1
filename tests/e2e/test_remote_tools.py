"""A remote MCP tool from the chat page: started in chat, followed and answered in the panel,
cancelled with one click, and each outcome told in the thread."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from playwright.sync_api import Page, expect

from tasks.models import Task, Tenant
from tests.conftest import make_user
from tests.e2e.chat_page import assistant_messages, open_panel, send, sign_in_with_cookie, task_row, wait_until
from tests.fakes.mcp_task_server import calls

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


def test_a_remote_tool_is_started_in_chat_answered_in_the_panel_cancelled_and_told(
        page: Page, server: str, mcp_server: Path, screenshots: Path, cheap_passwords):
    alice = make_user("alice", Tenant.objects.create(slug="acme", name="Acme"))
    sign_in_with_cookie(page, server, alice)
    page.goto(f"{server}/")
    before = calls(mcp_server)

    send(page, 'run approval_job on tools with {"seconds": 1, "poll_ms": 300}')
    expect(assistant_messages(page, "Started “approval_job on tools”")).to_have_count(1, timeout=15_000)
    open_panel(page)
    row = task_row(page, "approval_job on tools")
    expect(row.locator(".task-kind")).to_have_text("Remote tool", timeout=10_000)
    expect(row.locator(".status-word")).to_have_text("Needs your answer", timeout=20_000)
    expect(page.locator("#messages")).to_contain_text("Which format should the report use?", timeout=15_000)

    row.get_by_role("button", name="approval_job on tools", exact=True).click()
    row.get_by_role("textbox", name=re.compile("Which format should the report use?")).fill("pdf")
    row.get_by_role("button", name="Send answer").click()
    expect(row.locator(".status-word")).to_have_text("Done", timeout=20_000)
    expect(row.locator(".result-summary")).to_contain_text("report in pdf", timeout=10_000)
    expect(assistant_messages(page, "report in pdf")).to_have_count(1, timeout=15_000)
    page.screenshot(path=screenshots / "remote-tool-answered.png")

    send(page, 'run slow_report on tools with {"topic": "Q3 sales", "seconds": 120, "poll_ms": 300}')
    slow = task_row(page, "slow_report on tools")
    expect(slow.locator(".status-word")).to_have_text("Running", timeout=15_000)
    wait_until(lambda: Task.objects.filter(name="slow_report on tools", current_step__gte=1).exists(), timeout=20,
               message="the remote tool to be started")
    slow.get_by_role("button", name="Cancel “slow_report on tools”").click()
    expect(slow.locator(".status-word")).to_have_text("Cancelled", timeout=20_000)
    expect(assistant_messages(page, "was cancelled")).to_have_count(1, timeout=15_000)

    after = calls(mcp_server)
    assert after.get("tools/call:approval_job", 0) - before.get("tools/call:approval_job", 0) == 1
    assert after.get("tasks/update", 0) - before.get("tasks/update", 0) == 1
    assert after.get("tasks/cancel", 0) - before.get("tasks/cancel", 0) == 1
    # The thread was told of each event once: the question, the result, the cancel.
    told = Task.objects.get(name="approval_job on tools")
    assert told.result["summary"] == "report in pdf"


def test_a_remote_tools_form_is_filled_in_the_panel_and_declined_in_the_thread(
        page: Page, server: str, mcp_server: Path, screenshots: Path, cheap_passwords):
    alice = make_user("alice", Tenant.objects.create(slug="acme", name="Acme"))
    sign_in_with_cookie(page, server, alice)
    page.goto(f"{server}/")

    send(page, 'run ask_many on tools with {"seconds": 0.3, "poll_ms": 200}')
    expect(assistant_messages(page, "Started “ask_many on tools”")).to_have_count(1, timeout=15_000)
    # The thread tells of the question with its form under it.
    in_thread = page.locator("#messages .message-question form")
    expect(in_thread).to_have_count(1, timeout=20_000)
    expect(in_thread.get_by_label("Copies")).to_be_visible()

    open_panel(page)
    row = task_row(page, "ask_many on tools")
    expect(row.locator(".status-word")).to_have_text("Needs your answer", timeout=20_000)
    row.get_by_role("button", name="ask_many on tools", exact=True).click()
    form = row.locator("form.answer-form")
    form.get_by_label("Title").fill("Q3 summary")
    form.get_by_label("Copies").fill("3")
    form.get_by_label("Urgent").check()
    form.get_by_label("Format").select_option("html")
    page.screenshot(path=screenshots / "remote-tool-form.png")
    form.get_by_role("button", name="Send answer").click()

    expect(row.locator(".status-word")).to_have_text("Done", timeout=20_000)
    accepted = 'accepted {"copies": 3, "format": "html", "title": "Q3 summary", "urgent": true}'
    expect(row.locator(".result-summary")).to_contain_text(accepted, timeout=10_000)
    # Answered in the panel: the thread's form is gone.
    expect(in_thread).to_have_count(0)
    task = Task.objects.get(name="ask_many on tools")
    assert task.answer_data == {"action": "accept",
                                "content": {"title": "Q3 summary", "copies": 3, "urgent": True, "format": "html"}}

    send(page, 'run ask_many on tools with {"seconds": 0.3, "poll_ms": 200}')
    expect(in_thread).to_have_count(1, timeout=30_000)
    in_thread.get_by_role("button", name="Decline").click()
    expect(page.locator("#messages .message-question").last).to_have_text("You declined the question.")
    expect(assistant_messages(page, "is done")).to_have_count(2, timeout=20_000)
    wait_until(lambda: any((t.result or {}).get("summary") == "declined"  # the result is sealed: read, not queried
                           for t in Task.objects.filter(name="ask_many on tools")),
               timeout=10, message="the declined task's result")
