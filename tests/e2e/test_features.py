"""The page shows only what GET /api/features says is on; when that answer cannot be had, the task
panel stays hidden and a notice says so, with a way to try again."""

from __future__ import annotations

import pytest
from playwright.sync_api import Page, Route, expect

from tasks.models import Tenant
from tests.conftest import make_user
from tests.e2e.chat_page import sign_in

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


def test_a_failing_features_request_hides_the_panel_with_a_notice_and_try_again_recovers(page: Page, server: str):
    make_user("alice", Tenant.objects.create(slug="acme", name="Acme Research"))
    failing = {"on": True}

    def features(route: Route) -> None:
        if failing["on"]:
            route.fulfill(status=503, content_type="application/json",
                          body='{"error": "service unavailable", "code": "unavailable"}')
        else:
            route.continue_()

    page.route("**/api/features", features)
    sign_in(page, server, "alice")

    notice = page.locator("#features-error")
    expect(notice).to_be_visible()
    expect(notice).to_have_attribute("role", "alert")
    expect(notice).to_contain_text("the task panel is hidden")
    expect(page.locator("#panel-toggle")).to_be_hidden()
    expect(page.locator(".suggestion").first).to_be_hidden()  # the offline corpus's examples: off until known

    failing["on"] = False
    notice.get_by_role("button", name="Try again").click()
    expect(notice).to_be_hidden()
    expect(page.locator("#panel-toggle")).to_be_visible()
    expect(page.locator(".suggestion").first).to_be_visible()
    expect(page.locator("[data-feature=remote_tools]")).to_be_visible()  # the suite's MCP server serves every tenant
