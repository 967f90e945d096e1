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
