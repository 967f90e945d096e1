"""A remote tool call the model proposed: a card in the thread, and the task starts only on Confirm.

The e2e worker answers with the offline provider, whose typed commands are the user's own and never
proposals; so the test proposes through the function the model's tool calls go through
(chat.proposals.propose_remote_tool), then uses the page as a person would.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from playwright.sync_api import Page, expect

from chat import proposals
from chat.models import Proposal, Run
from tasks import clock
from tasks.models import Task, Tenant
from tests.conftest import make_user
from tests.e2e.chat_page import assistant_messages, make_thread, sign_in_with_cookie, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


def test_a_proposed_remote_tool_waits_for_confirm_and_then_starts_once(
        page: Page, server: str, mcp_server: Path, screenshots: Path, settings, cheap_passwords):
    settings.LONGHAUL_MCP_SERVERS = os.environ["LONGHAUL_MCP_SERVERS"]  # the servers daphne and the worker read
    alice = make_user("alice", Tenant.objects.create(slug="acme", name="Acme"))
    thread = make_thread(alice, "Reports")
    run = Run.objects.create(thread=thread, tenant=thread.tenant, status=Run.Status.SUCCEEDED,
                             created_at=clock.now())
    reply = proposals.propose_remote_tool(run, server="tools", tool="slow_report", name="", n=0,
                                          arguments={"topic": "<b>Q3</b>", "seconds": 1, "poll_ms": 300})
    assert "confirm" in reply.text and not Task.objects.exists()

    sign_in_with_cookie(page, server, alice)
    page.goto(f"{server}/t/{thread.public_id}/")
    card = page.get_by_role("region", name="Run the remote tool “slow_report” on tools?")
    expect(card).to_be_visible(timeout=15_000)
    # The arguments are shown as text, formatted: the model's words are never markup.
    expect(card.locator(".proposal-arguments")).to_contain_text('"topic": "<b>Q3</b>"')
    expect(card.locator("b")).to_have_count(0)
    page.screenshot(path=screenshots / "proposal-card.png")
    assert not Task.objects.exists()

    card.get_by_role("button", name="Confirm").click()

    expect(card.locator(".proposal-decision")).to_contain_text("You confirmed this.", timeout=15_000)
    expect(card.get_by_role("button", name="Confirm")).to_have_count(0)
    expect(assistant_messages(page, "Started “slow_report on tools”")).to_have_count(1, timeout=15_000)
    wait_until(lambda: Task.objects.filter(kind="mcp").exists(), timeout=10, message="the task to start")
    assert Task.objects.get().input["arguments"]["topic"] == "<b>Q3</b>"
    assert Proposal.objects.get().status == Proposal.Status.CONFIRMED

    # Drawn again on a fresh load, the card shows its decision and offers nothing more.
    page.reload()
    card = page.get_by_role("region", name="Run the remote tool “slow_report” on tools?")
    expect(card.locator(".proposal-decision")).to_contain_text("You confirmed this.", timeout=15_000)
    expect(card.get_by_role("button")).to_have_count(0)
    assert Task.objects.count() == 1
