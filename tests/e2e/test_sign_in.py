"""A person signs in and finds the chat shell and its task panel, on a laptop and on a phone."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from playwright.sync_api import Page, expect

from tasks.models import Tenant
from tests.conftest import make_user

# transaction=True: the daphne child can only see rows that are committed.
pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


def sign_in(page: Page, username: str, password: str) -> None:
    """Fill in and submit the login form the page shows."""
    page.get_by_label("Username").fill(username)
    page.get_by_label("Password").fill(password)
    page.get_by_role("button", name="Sign in").click()


def test_it_refuses_a_wrong_password_with_an_alert(page: Page, server: str, screenshots: Path):
    make_user("dana", Tenant.objects.create(slug="initech", name="Initech"))
    page.goto(f"{server}/accounts/login/")

    sign_in(page, "dana", "not-her-password")

    expect(page.get_by_role("alert")).to_contain_text("don't match")
    expect(page).to_have_url(re.compile(r"/accounts/login/$"))
    page.screenshot(path=screenshots / "login-error-desktop.png")


def test_it_signs_in_and_shows_the_chat_shell(page: Page, server: str, screenshots: Path):
    make_user("dana", Tenant.objects.create(slug="initech", name="Initech"))
    script_errors: list[str] = []
    page.on("pageerror", lambda error: script_errors.append(str(error)))

    page.goto(f"{server}/")
    expect(page).to_have_url(re.compile(r"/accounts/login/\?next=/$"))
    page.screenshot(path=screenshots / "login-desktop.png")
    sign_in(page, "dana", "dana-password-1")

    expect(page).to_have_url(f"{server}/")
    expect(page.get_by_role("banner").get_by_role("link", name="Longhaul")).to_be_visible()
    expect(page.get_by_role("banner")).to_contain_text("Initech")
    expect(page.get_by_role("button", name="New thread")).to_be_visible()
    expect(page.get_by_text("No threads yet")).to_be_visible()
    expect(page.get_by_role("textbox", name="Message")).to_be_visible()
    tasks = page.get_by_role("button", name="Tasks", exact=True)
    expect(tasks).to_be_visible()
    expect(tasks).to_have_attribute("aria-expanded", "false")
    expect(page.locator("#task-count")).to_be_hidden()
    panel = page.get_by_role("complementary", name="Background tasks")
    expect(panel).to_be_hidden()
    page.screenshot(path=screenshots / "chat-desktop.png")

    tasks.click()
    expect(panel).to_be_visible()
    expect(tasks).to_have_attribute("aria-expanded", "true")
    expect(panel.get_by_role("heading", name="Active")).to_be_visible()
    expect(panel.get_by_role("heading", name="Recent")).to_be_visible()
    expect(panel.get_by_text("Nothing running")).to_be_visible()
    page.screenshot(path=screenshots / "chat-desktop-panel.png")

    page.keyboard.press("Escape")
    expect(panel).to_be_hidden()
    expect(tasks).to_have_attribute("aria-expanded", "false")
    expect(tasks).to_be_focused()

    # A phone: the thread list collapses behind a button, the panel becomes a drawer.
    page.set_viewport_size({"width": 390, "height": 844})
    expect(page.get_by_role("button", name="New thread")).to_be_hidden()
    expect(tasks).to_be_visible()
    page.screenshot(path=screenshots / "chat-mobile.png")

    tasks.click()
    expect(panel).to_be_visible()
    expect(panel.get_by_role("heading", name="Recent")).to_be_visible()
    expect(panel).to_be_in_viewport(ratio=1)  # a drawer that fits the phone, once it has slid in
    page.screenshot(path=screenshots / "chat-mobile-panel.png")
    page.keyboard.press("Escape")
    expect(panel).to_be_hidden()

    page.get_by_role("button", name="Threads", exact=True).click()
    expect(page.get_by_role("button", name="New thread")).to_be_visible()
    expect(page.get_by_role("navigation", name="Threads")).to_be_in_viewport(ratio=1)
    page.screenshot(path=screenshots / "chat-mobile-threads.png")
    page.keyboard.press("Escape")
    expect(page.get_by_role("button", name="New thread")).to_be_hidden()
    assert script_errors == []
