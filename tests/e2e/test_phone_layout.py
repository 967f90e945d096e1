"""The chat page on a phone (390×844, touch): one drawer at a time, across rotations, and targets fingers can hit."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from playwright.sync_api import Locator, Page, expect

from tasks.models import Tenant
from tests.conftest import make_user
from tests.e2e.chat_page import assistant_messages, make_thread, sign_in_with_cookie, start_test_task, task_row

PORTRAIT = {"width": 390, "height": 844}
LANDSCAPE = {"width": 844, "height": 390}

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("compiled_catalogs"),
              pytest.mark.browser_context_args(viewport=PORTRAIT, has_touch=True, is_mobile=True)]

# What the page says, by language: the scenario is the same in both.
WORDS = {
    "en": {"threads": "Threads", "panel": "Background tasks", "box": "Message", "cancel": "Cancel “Nightly crawl”",
           "cancelled": "Cancelled"},
    "zh-hans": {"threads": "对话", "panel": "后台任务", "box": "消息", "cancel": "取消“Nightly crawl”",
                "cancelled": "已取消"},
}


def box(locator: Locator) -> dict:
    found = locator.bounding_box()
    assert found, f"{locator} has no box"
    return found


def assert_on_screen(locator: Locator) -> None:
    """Wholly inside the portrait viewport: nothing runs off the side."""
    area = box(locator)
    assert area["x"] >= 0 and area["x"] + area["width"] <= PORTRAIT["width"] + 0.5, area
    assert area["y"] >= 0 and area["y"] + area["height"] <= PORTRAIT["height"] + 0.5, area


def assert_big_enough(locator: Locator, *, least: float = 40) -> None:
    """A target a finger can hit (about 44 CSS px is the usual advice)."""
    for i in range(locator.count()):
        area = box(locator.nth(i))
        assert area["height"] >= least and area["width"] >= least, (locator.nth(i), area)


@pytest.mark.parametrize("language", ["en", "zh-hans"])
def test_one_drawer_at_a_time_on_a_phone_and_both_usable_by_touch(page: Page, server: str, screenshots: Path,
                                                                  cheap_passwords, language):
    words = WORDS[language]
    alice = make_user("alice", Tenant.objects.create(slug="acme", name="Acme Research"))
    for title in ("Heat pumps in cold climates", "Vector databases"):
        make_thread(alice, title)
    thread = make_thread(alice, "Nightly jobs")
    start_test_task(thread, steps=100, name="Nightly crawl")
    sign_in_with_cookie(page, server, alice)
    page.context.add_cookies([{"name": "django_language", "value": language, "url": server}])
    page.goto(f"{server}/t/{thread.public_id}/")
    expect(page.locator("#send")).to_be_enabled(timeout=15_000)
    app = page.locator("#app")
    nav = page.get_by_role("navigation", name=words["threads"])
    panel_toggle = page.locator("#panel-toggle")
    threads_toggle = page.locator("#threads-toggle")
    panel = page.locator("#task-panel")
    assert page.evaluate("document.documentElement.scrollWidth") <= PORTRAIT["width"], "no sideways scrolling"
    assert_on_screen(page.locator(".topbar"))
    assert_big_enough(page.locator(".topbar button:visible"))

    # The thread list, by touch.
    threads_toggle.tap()
    expect(nav).to_be_in_viewport(ratio=1)
    expect(threads_toggle).to_have_attribute("aria-expanded", "true")
    assert_big_enough(nav.locator(".thread-link"))
    page.screenshot(path=screenshots / f"phone-390x844-threads-{language}.png")

    # Turned sideways, the list is a column and the Tasks button is free: opening the panel closes the list.
    page.set_viewport_size(LANDSCAPE)
    panel_toggle.tap()
    expect(panel).to_be_visible()
    expect(threads_toggle).to_have_attribute("aria-expanded", "false")
    expect(app).not_to_have_attribute("data-threads-open", "")
    # Turned back: only the panel, wholly on the screen.
    page.set_viewport_size(PORTRAIT)
    expect(panel).to_be_in_viewport(ratio=1)
    expect(nav).to_be_hidden()
    assert_on_screen(panel)

    # Upright, from the keyboard too (the scrim covers the buttons for fingers): one drawer closes the other.
    threads_toggle.focus()
    page.keyboard.press("Enter")
    expect(nav).to_be_in_viewport(ratio=1)
    expect(panel).to_be_hidden()
    panel_toggle.focus()
    page.keyboard.press("Enter")
    expect(panel).to_be_in_viewport(ratio=1)
    expect(nav).to_be_hidden()
    expect(page.get_by_role("complementary", name=words["panel"])).to_be_focused()

    # The panel by touch: a row opens, its buttons are finger-sized, a cancel works.
    row = task_row(page, "Nightly crawl")
    row.locator(".task-toggle").tap()
    expect(row.locator(".task-details")).to_be_visible()
    expect(row.locator(".timeline li").first).to_be_visible(timeout=10_000)
    assert_big_enough(row.locator(".task-actions button:visible"))
    assert_big_enough(page.locator("#panel-close"))
    assert_on_screen(row)
    page.screenshot(path=screenshots / f"phone-390x844-panel-{language}.png")
    row.get_by_role("button", name=words["cancel"]).tap()
    expect(row.locator(".status-word")).to_have_text(words["cancelled"], timeout=10_000)

    # Back to the thread: the composer sits on the screen and sends by touch.
    page.locator("#panel-close").tap()
    expect(panel).to_be_hidden()
    composer = page.get_by_role("textbox", name=words["box"])
    assert_on_screen(page.locator("#composer"))
    assert_big_enough(page.locator("#send"))
    composer.tap()
    composer.fill("what is running?")
    page.locator("#send").tap()
    expect(assistant_messages(page, "Nightly crawl")).to_have_count(2, timeout=15_000)  # the cancel, the listing
    expect(page.locator("#messages .message").last).to_be_in_viewport()
    assert page.evaluate("document.documentElement.scrollWidth") <= PORTRAIT["width"]
    page.screenshot(path=screenshots / f"phone-390x844-thread-{language}.png")
    expect(page.locator("html")).to_have_attribute("lang", re.compile(f"^{language}$"))
