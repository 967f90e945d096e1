"""The pages work under the Content-Security-Policy: signing in, chatting, the task panel and the
admin raise no policy violation and no script error."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import User
from playwright.sync_api import Page, expect

from tasks.models import Tenant
from tests.conftest import make_user
from tests.e2e.chat_page import assistant_messages, open_panel, send, sign_in

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

# Records what the browser refused, in every document the page loads.
WATCH_VIOLATIONS = """
window.cspViolations = [];
document.addEventListener("securitypolicyviolation",
    (e) => window.cspViolations.push(`${e.violatedDirective} ${e.blockedURI}`));
"""


def violations(page: Page) -> list[str]:
    return page.evaluate("window.cspViolations")


def test_the_pages_work_under_the_content_security_policy(page: Page, server: str):
    make_user("alice", Tenant.objects.create(slug="acme", name="Acme Research"))
    User.objects.create_superuser("root", password="root-password-1")
    script_errors: list[str] = []
    page.on("pageerror", lambda error: script_errors.append(str(error)))
    page.add_init_script(WATCH_VIOLATIONS)

    response = page.goto(f"{server}/accounts/login/")
    assert "script-src 'self'" in response.headers["content-security-policy"]
    sign_in(page, server, "alice")
    send(page, "what is running?")
    expect(assistant_messages(page)).to_have_count(1, timeout=20_000)  # the page's script and its socket ran
    open_panel(page)
    expect(page.locator("#task-panel")).to_be_visible()
    assert violations(page) == []

    page.context.clear_cookies()
    page.goto(f"{server}/admin/login/")
    page.get_by_label("Username").fill("root")
    page.get_by_label("Password").fill("root-password-1")
    page.get_by_role("button", name="Log in").click()
    expect(page.get_by_role("heading", name="Site administration")).to_be_visible()
    page.goto(f"{server}/admin/tasks/task/")
    expect(page.locator("#changelist")).to_be_visible()
    assert violations(page) == []
    assert script_errors == []
