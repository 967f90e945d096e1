"""Chatting with background tasks: research from a new thread, two tasks and a one-click cancel.

One daphne and one qcluster serve the whole session (conftest); each test signs in its own user
(the database is emptied between tests) and leaves nothing running behind it.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from playwright.sync_api import Page, expect

from chat.models import Message
from tasks.models import Task, TaskEvent, Tenant
from tasks.statuses import NotificationStatus
from tests.conftest import make_user
from tests.e2e.chat_page import (
    THREAD_URL, api_message_ids, assistant_messages, expect_live_label_shown, open_panel, record_live_labels,
    rendered_message_ids, send, sign_in, sign_in_with_cookie, task_row, thread_id_of, wait_until,
)

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

RESEARCH = "Research: how asyncio cancellation works"
PHASES_IN_ORDER = ["queued", "admitted", "planning", "searching", "source_read", "evidence_added", "drafting",
                   "result_ready", "succeeded"]


def timeline_seqs(row) -> list[int]:
    return [int(s) for s in row.locator(".timeline li").evaluate_all("els => els.map(e => e.dataset.seq)")]


def test_it_researches_from_a_new_thread_and_posts_the_report_with_citations(page: Page, server: str,
                                                                            screenshots: Path):
    make_user("alice", Tenant.objects.create(slug="acme", name="Acme Research"))
    script_errors: list[str] = []
    page.on("pageerror", lambda error: script_errors.append(str(error)))
    sign_in(page, server, "alice")

    send(page, "research how asyncio cancellation works")

    # The first message made a thread, and the page became that thread's page.
    expect(page).to_have_url(THREAD_URL)
    thread_id = thread_id_of(page)
    threads = page.get_by_role("navigation", name="Threads")
    expect(threads.get_by_role("link", name="research how asyncio cancellation works")).to_have_attribute(
        "aria-current", "page")
    expect(page.get_by_role("heading", level=1)).to_have_text("research how asyncio cancellation works")
    expect(page.locator("#messages .message.from-user .message-text")).to_have_text(
        "research how asyncio cancellation works")
    expect(assistant_messages(page, "I'm researching")).to_have_count(1)

    # The panel shows the task active within seconds, and its phases advance live.
    expect(page.locator("#task-count")).to_contain_text("1", timeout=10_000)
    panel = open_panel(page)
    row = task_row(page, RESEARCH)
    expect(panel.locator("#active-tasks").locator(".task-name")).to_have_text([RESEARCH], timeout=10_000)
    expect(row.locator(".task-kind")).to_have_text("Research")
    record_live_labels(page)
    row.get_by_role("button", name=RESEARCH, exact=True).click()
    expect(row.get_by_role("button", name=RESEARCH, exact=True)).to_have_attribute("aria-expanded", "true")
    timeline = row.locator(".timeline")
    expect(timeline).to_contain_text("Planning sub-questions", timeout=10_000)
    expect_live_label_shown(page, "Live")
    expect(timeline).to_contain_text("Read source [1]", timeout=15_000)
    expect(timeline).to_contain_text("Drafting the report", timeout=15_000)

    # Done: the row moves to Recent, and the report comes back as one assistant message.
    expect(panel.locator("#recent-tasks .task-row[data-status=succeeded] .task-name")).to_have_text(
        [RESEARCH], timeout=30_000)
    expect(row.locator(".status-word")).to_have_text("Done")
    expect(page.locator("#task-count")).to_be_hidden()
    report = assistant_messages(page, f"{RESEARCH} is done")
    expect(report).to_have_count(1, timeout=20_000)

    # Its citations link to the source list inside the same message.
    task = Task.objects.get(thread__public_id=thread_id)
    sources = task.result["sources"]
    expect(report.locator("ol.sources li")).to_have_count(len(sources))
    citation = report.locator("a.cite").first
    expect(citation).to_be_visible()
    target = citation.get_attribute("href")
    assert re.fullmatch(r"#m\d+-src-\d+", target), target
    entry = report.locator(f"li{target}")
    expect(entry).to_have_count(1)
    citation.click()
    expect(entry).to_be_focused()
    expect(entry).to_be_in_viewport()
    expect(page).to_have_url(f"{server}/t/{thread_id}/")  # no #fragment pushed into the history

    # The timeline is the task's events, each once and in order, and the details add up.
    seqs = list(task.events.order_by("seq").values_list("seq", flat=True))
    expect(timeline.locator("li")).to_have_count(len(seqs))
    assert timeline_seqs(row) == seqs
    kinds = list(task.events.order_by("seq").values_list("kind", flat=True))
    assert [k for k in PHASES_IN_ORDER if k in kinds] == PHASES_IN_ORDER
    expect(row.locator(".source-list li")).to_have_count(len(sources))
    expect(row.locator(".facts")).to_contain_text(f"{len(task.result['evidence'])} quotes")
    expect(row.locator(".facts")).to_contain_text("Model calls")
    expect(row.locator(".facts")).to_contain_text(f"{task.model_name}, prompts version {task.prompt_version}")
    expect(row.get_by_role("button", name="Show the report in the thread")).to_be_visible()

    # Something running next to it, for the screenshots: the panel with a live task.
    row.get_by_role("button", name=RESEARCH, exact=True).click()
    send(page, "run a test task of 30 steps")
    sleeper = task_row(page, "Test task (30 steps)")
    expect(panel.locator("#active-tasks").locator(sleeper)).to_have_count(1, timeout=10_000)
    sleeper.get_by_role("button", name="Test task (30 steps)", exact=True).click()
    expect(sleeper.locator(".timeline")).to_contain_text("Step 2 of 30 done", timeout=10_000)
    expect(sleeper.locator(".task-phase")).to_have_text(re.compile(r"Step \d+ of 30"))
    page.locator("#conversation").evaluate("c => c.scrollTop = c.scrollHeight")
    page.mouse.move(640, 780)  # no hover highlight in the picture
    page.screenshot(path=screenshots / "chat-panel-desktop.png")

    page.set_viewport_size({"width": 390, "height": 844})
    expect(panel).to_be_in_viewport(ratio=1)
    page.screenshot(path=screenshots / "chat-panel-mobile.png")
    page.keyboard.press("Escape")
    expect(panel).to_be_hidden()
    page.screenshot(path=screenshots / "chat-thread-mobile.png")
    assert script_errors == []


def test_it_cancels_one_of_two_tasks_with_one_click_and_tells_each_once(page: Page, server: str, cheap_passwords):
    bob = make_user("bob", Tenant.objects.create(slug="acme", name="Acme"))
    sign_in_with_cookie(page, server, bob)
    page.goto(f"{server}/")
    send(page, "run a test task of 5 steps")
    expect(assistant_messages(page, "Test task (5 steps)")).to_have_count(1, timeout=10_000)
    send(page, "run a test task of 9 steps")
    expect(assistant_messages(page, "Test task (9 steps)")).to_have_count(1, timeout=10_000)
    thread_id = thread_id_of(page)

    panel = open_panel(page)
    expect(panel.locator("#active-tasks .task-row")).to_have_count(2)
    expect(page.locator("#task-count")).to_contain_text("2")
    doomed = task_row(page, "Test task (9 steps)")
    kept = task_row(page, "Test task (5 steps)")
    cancel = doomed.get_by_role("button", name="Cancel “Test task (9 steps)”")

    cancel.click()
    # At once, before the server has answered: the button says what is happening.
    expect(doomed.locator('[data-action="cancel"]')).to_have_text("Cancelling…", timeout=500)
    expect(doomed.locator('[data-action="cancel"]')).to_have_attribute("aria-disabled", "true")

    recent = panel.locator("#recent-tasks")
    expect(recent.locator(doomed)).to_have_count(1, timeout=10_000)
    expect(doomed.locator(".status-word")).to_have_text("Cancelled")
    expect(kept).to_have_attribute("data-status", "running")
    expect(recent.locator(kept)).to_have_count(1, timeout=20_000)
    expect(kept.locator(".status-word")).to_have_text("Done")

    # The chat says each once, in the order they happened.
    cancelled_note = assistant_messages(page, "Test task (9 steps) was cancelled")
    done_note = assistant_messages(page, "Test task (5 steps) is done")
    expect(cancelled_note).to_have_count(1, timeout=15_000)
    expect(done_note).to_have_count(1, timeout=15_000)
    tasks = Task.objects.filter(thread__public_id=thread_id)
    wait_until(lambda: all(t.notification_status == NotificationStatus.DELIVERED for t in tasks.all()),
               timeout=15, message="both notifications delivered")
    wait_until(lambda: rendered_message_ids(page) == api_message_ids(page, server, thread_id), timeout=10,
               message="the page to show exactly what GET /api/threads/<id>/messages lists")
    expect(cancelled_note).to_have_count(1)
    expect(done_note).to_have_count(1)
    notes = Message.objects.filter(thread__public_id=thread_id, role="assistant", run__kind="notification")
    assert notes.count() == 2
    ids = rendered_message_ids(page)
    assert ids == sorted(set(ids))
    assert Task.objects.get(name="Test task (9 steps)").status == "cancelled"
    assert TaskEvent.objects.filter(task__name="Test task (9 steps)", kind="cancelled").count() == 1


def test_the_report_answers_first_and_a_citation_opens_the_cited_section(page: Page, server: str):
    make_user("alice", Tenant.objects.create(slug="acme", name="Acme Research"))
    sign_in(page, server, "alice")

    send(page, "research what is the global interpreter lock and how does it affect threads?")
    name = "Research: what is the global interpreter lock and how does it affect threads"
    report = assistant_messages(page, f"{name} is done")
    expect(report).to_have_count(1, timeout=60_000)

    # It opens with a direct answer: a paragraph of sentences, each with its citation.
    task = Task.objects.get(thread__public_id=thread_id_of(page))
    answer = task.result["report"].split("\n\n", 1)[0]
    paragraph = report.locator(".prose p").filter(has_text=answer.split(" [", 1)[0][-40:]).first
    expect(paragraph).to_be_visible()
    expect(paragraph.locator("a.cite")).to_have_count(len(re.findall(r"\[\d+\]", answer)))

    # A citation of the answer leads to its source, which links to its section in Longhaul and to docs.python.org.
    citation = paragraph.locator("a.cite").first
    n = int(citation.inner_text().strip("[]"))
    citation.click()
    source = next(s for s in task.result["sources"] if s["n"] == n)
    entry = report.locator(f"ol.sources li[value='{n}']")
    expect(entry).to_be_focused()
    expect(entry.get_by_role("link", name=source["title"])).to_have_attribute(
        "href", f"/tasks/{task.public_id}/sources/{source['n']}/")
    expect(entry.locator(f"a[href='{source['origin_url']}']")).to_have_count(1)
    with page.context.expect_page() as opened:
        entry.get_by_role("link", name=source["title"]).click()
    section = opened.value
    section.wait_for_load_state()
    expect(section.get_by_role("heading", level=1)).to_have_text(source["title"])
    quoted = next(e["quote"] for e in task.result["evidence"] if e["n"] == source["n"])
    expect(section.locator("mark").filter(has_text=quoted[:60]).first).to_be_visible()
    expect(section.get_by_role("link", name="Open on docs.python.org")).to_have_attribute("href",
                                                                                         source["origin_url"])
    section.close()

    # A source title with Markdown's special characters keeps them in its link (the label is escaped).
    html = page.evaluate("""async () => (await import('/static/js/markdown.js')).markdownToHtml(
        '[1] [object.\\\\_\\\\_init\\\\_\\\\_](/tasks/x/sources/1/) — https://docs.python.org/3.11/')""")
    assert '<a href="/tasks/x/sources/1/" target="_blank" rel="noopener noreferrer">object.__init__</a>' in html
