"""The task panel: its polling cadence (under Playwright's clock) and driving it by keyboard alone."""

from __future__ import annotations

import re

import pytest
from playwright.sync_api import Locator, Page, expect

from tasks import actions, clock
from tasks.models import Task, Tenant
from tasks.statuses import NotificationStatus, TaskStatus
from tests.conftest import make_user
from tests.factories import make_task
from tests.e2e.chat_page import make_thread, sign_in_with_cookie, start_test_task, task_row, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

# Counts the panel's requests (GET /api/threads/<id>/tasks) with the page's own clock,
# and the most that were ever in flight at once.
COUNT_TASK_LIST_REQUESTS = r"""
(() => {
  const original = window.fetch;
  const polls = { at: [], inFlight: 0, maxInFlight: 0 };
  window.__taskListPolls = polls;
  window.fetch = function (input, init) {
    const url = new URL(typeof input === "string" ? input : input.url, location.href);
    if (!/^\/api\/threads\/[^/]+\/tasks$/.test(url.pathname)) return original.apply(this, arguments);
    polls.at.push(Date.now());
    polls.inFlight += 1;
    polls.maxInFlight = Math.max(polls.maxInFlight, polls.inFlight);
    return original.apply(this, arguments).finally(() => { polls.inFlight -= 1; });
  };
})();
"""

SET_VISIBILITY = """(state) => {
  Object.defineProperty(document, "visibilityState", { value: state, configurable: true });
  Object.defineProperty(document, "hidden", { value: state === "hidden", configurable: true });
  document.dispatchEvent(new Event("visibilitychange"));
}"""


def poll_times(page: Page) -> list[int]:
    return page.evaluate("window.__taskListPolls.at")


def settled(page: Page) -> None:
    """The panel's request in flight (if any) has been handled and the next one scheduled."""
    expect(page.locator("#task-panel")).not_to_have_attribute("aria-busy", "true")


def test_it_polls_every_3_s_with_an_active_task_every_15_s_without_and_not_while_hidden(page: Page, server: str,
                                                                                       cheap_passwords):
    alice = make_user("alice", Tenant.objects.create(slug="acme", name="Acme"))
    thread = make_thread(alice, "Nightly jobs")
    task = start_test_task(thread, steps=100, name="Nightly crawl")
    sign_in_with_cookie(page, server, alice)
    # A silent thread stream: here only polling may refresh the panel.
    page.route_web_socket(re.compile(r"/ws/threads/"), lambda ws: None)
    page.add_init_script(COUNT_TASK_LIST_REQUESTS)
    page.clock.install()
    page.goto(f"{server}/t/{thread.public_id}/")
    expect(page.locator("#task-count")).to_have_text(re.compile(r"1$"))
    page.clock.pause_at(page.evaluate("Date.now()") / 1000 + 1)  # seconds
    page.clock.run_for(3_000)  # whatever poll was due has run: the next is exactly one interval away
    settled(page)

    # Active: exactly every 3 s, one request each time.
    start = len(poll_times(page))
    for n in range(1, 4):
        page.clock.run_for(2_900)
        assert len(poll_times(page)) == start + n - 1
        page.clock.run_for(100)
        assert len(poll_times(page)) == start + n
        settled(page)
    times = poll_times(page)[start:]
    assert [b - a for a, b in zip(times, times[1:])] == [3000, 3000]

    # Nothing active any more: the next poll sees it, then every 15 s.
    actions.request_cancel(task, user=alice)
    wait_until(lambda: Task.objects.get(pk=task.pk).status == "cancelled", timeout=10, message="the cancel")
    page.clock.run_for(3_000)
    settled(page)
    expect(page.locator("#recent-tasks .task-name")).to_have_text(["Nightly crawl"])
    expect(page.locator("#task-count")).to_be_hidden()
    count = len(poll_times(page))
    page.clock.run_for(14_900)
    assert len(poll_times(page)) == count
    page.clock.run_for(100)
    assert len(poll_times(page)) == count + 1
    settled(page)

    # Hidden: not one request, however long; visible again: one at once, then the cadence.
    page.evaluate(SET_VISIBILITY, "hidden")
    count = len(poll_times(page))
    page.clock.run_for(120_000)
    assert len(poll_times(page)) == count
    start_test_task(thread, steps=100, name="Second crawl")
    page.evaluate(SET_VISIBILITY, "visible")
    assert len(poll_times(page)) == count + 1
    settled(page)
    expect(page.locator("#active-tasks .task-name")).to_have_text(["Second crawl"])
    page.clock.run_for(3_000)
    assert len(poll_times(page)) == count + 2
    settled(page)

    # Many reasons to refresh at once still make one request at a time.
    page.evaluate("() => { for (let i = 0; i < 5; i++) document.dispatchEvent(new Event('visibilitychange')); }")
    settled(page)
    assert len(poll_times(page)) <= count + 4
    assert page.evaluate("window.__taskListPolls.maxInFlight") == 1


def press_tab_until_focused(page: Page, target: Locator, *, limit: int = 30) -> None:
    for _ in range(limit):
        if target.evaluate("el => el === document.activeElement"):
            return
        page.keyboard.press("Tab")
    raise AssertionError(f"Tab never reached {target}")


def test_it_opens_the_panel_expands_a_row_and_cancels_by_keyboard_alone(page: Page, server: str):
    alice = make_user("alice", Tenant.objects.create(slug="acme", name="Acme"))
    thread = make_thread(alice, "Nightly jobs")
    task = start_test_task(thread, steps=100, name="Nightly crawl")
    page.goto(f"{server}/t/{thread.public_id}/")
    page.get_by_label("Username").focus()
    page.keyboard.type("alice")
    page.keyboard.press("Tab")
    page.keyboard.type("alice-password-1")
    page.keyboard.press("Enter")
    expect(page).to_have_url(f"{server}/t/{thread.public_id}/")
    expect(page.locator("#task-count")).to_have_text(re.compile(r"1$"))

    tasks_button = page.get_by_role("button", name=re.compile(r"^Tasks"))
    press_tab_until_focused(page, tasks_button)
    page.keyboard.press("Enter")
    panel = page.get_by_role("complementary", name="Background tasks")
    expect(panel).to_be_visible()
    expect(panel).to_be_focused()

    row = task_row(page, "Nightly crawl")
    toggle = row.get_by_role("button", name="Nightly crawl", exact=True)
    press_tab_until_focused(page, toggle, limit=3)
    page.keyboard.press("Enter")
    expect(toggle).to_have_attribute("aria-expanded", "true")
    expect(row.locator(".task-details")).to_be_visible()
    expect(row.locator(".timeline")).to_contain_text("Queued")

    cancel = row.get_by_role("button", name="Cancel “Nightly crawl”")
    press_tab_until_focused(page, cancel, limit=3)
    page.keyboard.press("Enter")
    expect(row.locator('[data-action="cancel"]')).to_have_text("Cancelling…")

    # Cancelled at the task's next safe point: the row moves to Recent and keeps the focus.
    expect(page.locator("#recent-tasks").locator(row)).to_have_count(1, timeout=10_000)
    expect(row.locator(".status-word")).to_have_text("Cancelled")
    expect(toggle).to_be_focused()
    assert Task.objects.get(pk=task.pk).status == "cancelled"

    page.keyboard.press("Escape")
    expect(panel).to_be_hidden()
    expect(tasks_button).to_be_focused()


def test_it_pauses_and_resumes_a_running_task(page: Page, server: str, cheap_passwords):
    alice = make_user("alice", Tenant.objects.create(slug="acme", name="Acme"))
    thread = make_thread(alice, "Nightly jobs")
    task = start_test_task(thread, steps=100, name="Nightly crawl")
    sign_in_with_cookie(page, server, alice)
    page.goto(f"{server}/t/{thread.public_id}/")
    page.locator("#panel-toggle").click()
    row = task_row(page, "Nightly crawl")
    expect(row).to_have_attribute("data-status", "running", timeout=10_000)
    expect(row.get_by_role("button", name="Resume “Nightly crawl”")).to_be_hidden()

    row.get_by_role("button", name="Pause “Nightly crawl”").click()
    expect(row.locator('[data-action="pause"]')).to_have_text("Pausing…", timeout=500)
    expect(row.locator(".status-word")).to_have_text("Paused", timeout=10_000)
    expect(row.get_by_role("button", name="Pause “Nightly crawl”")).to_be_hidden()
    assert Task.objects.get(pk=task.pk).status == "paused"
    expect(page.locator("#active-tasks").locator(row)).to_have_count(1)  # paused is not over

    row.get_by_role("button", name="Resume “Nightly crawl”").click()
    expect(row.locator(".status-word")).to_have_text("Running", timeout=10_000)
    expect(row.get_by_role("button", name="Pause “Nightly crawl”")).to_be_visible()


def test_an_ended_task_is_deleted_from_the_panel_after_a_confirmation(page: Page, server: str, cheap_passwords):
    alice = make_user("alice", Tenant.objects.create(slug="acme", name="Acme"))
    thread = make_thread(alice, "Nightly jobs")
    running = start_test_task(thread, steps=100, name="Nightly crawl")
    ended = make_task(thread.tenant, alice, status=TaskStatus.FAILED, thread=thread, name="Old crawl",
                      finished_at=clock.now())
    sign_in_with_cookie(page, server, alice)
    page.goto(f"{server}/t/{thread.public_id}/")
    page.locator("#panel-toggle").click()
    row = task_row(page, "Old crawl")
    expect(task_row(page, "Nightly crawl").get_by_role("button", name="Delete “Nightly crawl”")).to_be_hidden()

    row.get_by_role("button", name="Delete “Old crawl”").click()
    dialog = page.get_by_role("dialog", name="Delete this task?")
    expect(dialog).to_contain_text("“Old crawl”")
    dialog.get_by_role("button", name="Keep it").click()
    expect(dialog).to_be_hidden()
    assert Task.objects.filter(pk=ended.pk).exists(), "keeping it changes nothing"

    row.get_by_role("button", name="Delete “Old crawl”").click()
    dialog.get_by_role("button", name="Delete task").click()
    expect(row).to_have_count(0)
    expect(page.locator("#task-live")).to_have_text("Old crawl: Deleted")
    assert not Task.objects.filter(pk=ended.pk).exists()
    assert Task.objects.filter(pk=running.pk).exists()


def test_it_asks_the_tasks_question_with_an_answer_box_and_shows_a_failure_with_its_error(
        page: Page, server: str, cheap_passwords):
    alice = make_user("alice", Tenant.objects.create(slug="acme", name="Acme"))
    thread = make_thread(alice, "Mirrors")
    asking = start_test_task(thread, steps=2, name="Mirror sync", ask_at_step=1, question="Which mirror, EU or US?")
    start_test_task(thread, steps=3, name="Broken import", fail_at_step=1, fail_kind="permanent")
    sign_in_with_cookie(page, server, alice)
    page.goto(f"{server}/t/{thread.public_id}/")
    page.locator("#panel-toggle").click()

    broken = task_row(page, "Broken import")
    expect(page.locator("#recent-tasks").locator(broken)).to_have_count(1, timeout=10_000)
    expect(broken.locator(".status-word")).to_have_text("Failed")
    broken.get_by_role("button", name="Broken import", exact=True).click()
    expect(broken.locator(".note.error")).to_contain_text("Failed: permanent")
    expect(broken.locator(".note.error")).to_contain_text("step 1 failed permanently, as asked")

    row = task_row(page, "Mirror sync")
    expect(row.locator(".status-word")).to_have_text("Needs your answer", timeout=10_000)
    row.get_by_role("button", name="Mirror sync", exact=True).click()
    answer = row.get_by_role("textbox", name=re.compile("Which mirror, EU or US?"))
    answer.fill("EU, please")
    row.get_by_role("button", name="Send answer").click()
    expect(row.locator(".task-details")).to_contain_text("You answered: EU, please", timeout=10_000)
    expect(row.locator(".answer-form")).to_have_count(0)
    expect(row.locator(".status-word")).to_have_text("Done", timeout=15_000)
    assert Task.objects.get(pk=asking.pk).result["summary"].endswith("You answered: EU, please")
    # And the thread was told, without a reload.
    expect(page.locator("#messages")).to_contain_text("Mirror sync is done", timeout=15_000)
    expect(page.locator("#messages")).to_contain_text("Broken import failed")


def test_it_counts_active_tasks_up_to_9_plus_and_flags_an_undelivered_notification(
        page: Page, server: str, cheap_passwords):
    alice = make_user("alice", Tenant.objects.create(slug="acme", name="Acme"))
    thread = make_thread(alice, "Batch")
    # A scene: ten paused tasks (active, and no worker will touch them) and one failed
    # task whose notification could not be delivered.
    for n in range(10):
        make_task(thread.tenant, alice, status=TaskStatus.PAUSED, name=f"Batch part {n + 1}", thread=thread)
    make_task(thread.tenant, alice, status=TaskStatus.FAILED, name="Report upload", thread=thread,
              error_class="permanent", error_message="the upload server said no",
              notification_status=NotificationStatus.DEAD_LETTER, finished_at=clock.now())
    sign_in_with_cookie(page, server, alice)
    page.goto(f"{server}/t/{thread.public_id}/")

    badge = page.locator("#task-count")
    expect(badge).to_have_text("active: 9+")
    page.locator("#panel-toggle").click()
    expect(page.locator("#active-tasks .task-row")).to_have_count(10)
    expect(page.locator("#active-tasks .status-word").first).to_have_text("Paused")
    expect(page.locator("#active-tasks").get_by_role("button", name=re.compile("^Resume"))).to_have_count(10)

    failed = task_row(page, "Report upload")
    failed.get_by_role("button", name="Report upload", exact=True).click()
    expect(failed.locator(".note.error")).to_contain_text("Failed: permanent")
    expect(failed.locator(".note.error")).to_contain_text("the upload server said no")
    expect(failed.locator("[data-notification=dead_letter]")).to_contain_text("could not be posted to this thread")
