"""The research-and-cancel scenario of test_chat.py in a browser that asks for Simplified Chinese.

The same behaviour (a live timeline, one report with citations, a one-click cancel, each
event told once), with Chinese words throughout; what the user and the sources wrote
(task names' topics, questions, reports) stays as it was written.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from playwright.sync_api import Locator, Page, expect

from chat.models import LanguagePreference, Message
from tasks.models import Task, TaskEvent, Tenant
from tasks.statuses import NotificationStatus
from tests.conftest import make_user
from tests.e2e.chat_page import (
    THREAD_URL, api_message_ids, assistant_messages, expect_live_label_shown, open_panel, record_live_labels,
    rendered_message_ids, send, task_row, thread_id_of, wait_until,
)

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("compiled_catalogs"),
              pytest.mark.browser_context_args(locale="zh-CN")]

RESEARCH = "研究 · how asyncio cancellation works"
MESSAGE_BOX = "消息"
PANEL = "后台任务"
# Latin letters a Chinese page shows too: the product's name, keys, and the word for model tokens.
LATIN_ALLOWED = re.compile(r"Longhaul|Enter|Shift|Token")


def assert_all_chinese(locator: Locator) -> None:
    """No English word in what these elements show (Chinese, digits and punctuation only)."""
    for text in locator.all_inner_texts():
        assert not re.search(r"[A-Za-z]", LATIN_ALLOWED.sub("", text)), f"English left in {text!r}"


def test_it_researches_and_cancels_in_chinese_with_the_same_behaviour(page: Page, server: str, screenshots: Path):
    make_user("alice", Tenant.objects.create(slug="acme", name="Acme Research"))
    script_errors: list[str] = []
    page.on("pageerror", lambda error: script_errors.append(str(error)))

    # Signing in: the browser's Accept-Language picks the language.
    page.goto(f"{server}/accounts/login/")
    expect(page.locator("html")).to_have_attribute("lang", "zh-hans")
    expect(page.get_by_role("heading", level=1)).to_have_text("登录你的工作区")
    page.get_by_label("用户名").fill("alice")
    page.get_by_label("密码").fill("alice-password-1")
    page.get_by_role("button", name="登录", exact=True).click()
    expect(page).to_have_url(f"{server}/")
    expect(page.get_by_role("heading", level=1, name="想让 Longhaul 研究什么？")).to_be_visible()
    expect(page.get_by_role("textbox", name=MESSAGE_BOX)).to_have_attribute("placeholder", "提出研究请求…")
    assert_all_chinese(page.locator(".tasks-toggle, #thread-nav .section-title, .welcome > p, .composer"))
    expect(page.locator(".suggestion").first).to_have_text("研究 asyncio 的取消机制")

    send(page, "research how asyncio cancellation works", box_name=MESSAGE_BOX)

    expect(page).to_have_url(THREAD_URL)
    thread_id = thread_id_of(page)
    expect(page.get_by_role("heading", level=1)).to_have_text("research how asyncio cancellation works")
    expect(assistant_messages(page, "我正在后台研究“how asyncio cancellation works”")).to_have_count(1)
    expect(page.locator("#messages .message.from-assistant").first).to_have_attribute("aria-label", "Longhaul 说")

    # The panel, live, in Chinese; the task's name keeps the user's words.
    expect(page.locator("#task-count")).to_contain_text("1", timeout=10_000)
    panel = open_panel(page, name=PANEL)
    row = task_row(page, RESEARCH)
    expect(panel.locator("#active-tasks .task-name")).to_have_text([RESEARCH], timeout=10_000)
    expect(row.locator(".task-kind")).to_have_text("研究")
    expect(row.locator(".task-since")).to_have_text(re.compile(r"^(刚刚开始|.+前开始)$"))
    record_live_labels(page)
    row.get_by_role("button", name=RESEARCH, exact=True).click()
    timeline = row.locator(".timeline")
    expect(timeline).to_contain_text("正在规划子问题", timeout=10_000)
    expect_live_label_shown(page, "实时")
    expect(row.locator(".timeline-head h4")).to_have_text("时间线")
    expect(timeline).to_contain_text("已阅读来源 [1]", timeout=15_000)
    expect(timeline).to_contain_text("正在根据", timeout=15_000)
    assert_all_chinese(panel.locator(".panel-head, .panel-section > h3, .task-meta, .task-actions button:visible"))

    # Done: to Recent, and the report once in the thread, its citations linked within it.
    expect(panel.locator("#recent-tasks .task-row[data-status=succeeded] .task-name")).to_have_text(
        [RESEARCH], timeout=30_000)
    expect(row.locator(".status-word")).to_have_text("已完成")
    expect(row.locator(".task-since")).to_have_text(re.compile(r"^(刚刚结束|.+前结束)$"))
    report = assistant_messages(page, f"{RESEARCH} 已完成。")
    expect(report).to_have_count(1, timeout=20_000)
    task = Task.objects.get(thread__public_id=thread_id)
    expect(report.locator("ol.sources li")).to_have_count(len(task.result["sources"]))
    citation = report.locator("a.cite").first
    expect(citation).to_have_attribute("aria-label", re.compile(r"^来源 \d+$"))
    citation.click()
    expect(report.locator(f"li{citation.get_attribute('href')}")).to_be_focused()
    facts = row.locator(".facts")
    expect(facts).to_contain_text(f"{len(task.result['evidence'])} 条引文")
    expect(facts).to_contain_text("模型调用")
    expect(facts).to_contain_text(f"{task.model_name}，提示词版本 {task.prompt_version}")
    expect(facts).to_contain_text("用时")
    assert_all_chinese(facts.locator("dt"))
    expect(row.get_by_role("button", name="在对话中查看报告")).to_be_visible()
    seqs = list(task.events.order_by("seq").values_list("seq", flat=True))
    expect(timeline.locator("li")).to_have_count(len(seqs))
    row.get_by_role("button", name=RESEARCH, exact=True).click()

    # Two test tasks, and one cancelled with one click.
    send(page, "run a test task of 5 steps", box_name=MESSAGE_BOX)
    expect(assistant_messages(page, "已在后台启动“5 步测试任务”")).to_have_count(1, timeout=10_000)
    send(page, "run a test task of 9 steps", box_name=MESSAGE_BOX)
    expect(assistant_messages(page, "已在后台启动“9 步测试任务”")).to_have_count(1, timeout=10_000)
    expect(panel.locator("#active-tasks .task-row")).to_have_count(2)
    doomed = task_row(page, "9 步测试任务")
    kept = task_row(page, "5 步测试任务")
    expect(doomed.locator(".task-kind")).to_have_text("测试任务")
    doomed.get_by_role("button", name="取消“9 步测试任务”").click()
    expect(doomed.locator('[data-action="cancel"]')).to_have_text("正在取消…", timeout=500)
    expect(doomed.locator('[data-action="cancel"]')).to_have_attribute("aria-disabled", "true")
    expect(panel.locator("#recent-tasks").locator(doomed)).to_have_count(1, timeout=10_000)
    expect(doomed.locator(".status-word")).to_have_text("已取消")
    expect(kept.locator(".status-word")).to_have_text("运行中")
    expect(panel.locator("#recent-tasks").locator(kept)).to_have_count(1, timeout=20_000)
    expect(kept.locator(".status-word")).to_have_text("已完成")

    cancelled_note = assistant_messages(page, "9 步测试任务 已取消。它记录下的一切都会保留。")
    done_note = assistant_messages(page, "5 步测试任务 已完成。")
    expect(cancelled_note).to_have_count(1, timeout=15_000)
    expect(done_note).to_have_count(1, timeout=15_000)
    tasks = Task.objects.filter(thread__public_id=thread_id)
    wait_until(lambda: all(t.notification_status == NotificationStatus.DELIVERED for t in tasks.all()),
               timeout=15, message="every notification delivered")
    wait_until(lambda: rendered_message_ids(page) == api_message_ids(page, server, thread_id), timeout=10,
               message="the page to show exactly what GET /api/threads/<id>/messages lists")
    expect(cancelled_note).to_have_count(1)
    expect(done_note).to_have_count(1)
    assert Message.objects.filter(thread__public_id=thread_id, role="assistant", run__kind="notification").count() == 3
    assert TaskEvent.objects.filter(task__name="9 步测试任务", kind="cancelled").count() == 1
    page.mouse.move(640, 780)
    page.screenshot(path=screenshots / "chat-panel-desktop-zh-hans.png")

    # The switch in the header: English from now on, in this browser and any other.
    page.get_by_role("form", name="语言").get_by_role("button", name="English").click()
    expect(page).to_have_url(f"{server}/t/{thread_id}/")
    expect(page.locator("html")).to_have_attribute("lang", "en")
    expect(page.locator("#send")).to_be_enabled(timeout=15_000)  # the page's script has started
    expect(open_panel(page)).to_contain_text("Background tasks")
    expect(task_row(page, RESEARCH).locator(".status-word")).to_have_text("Done")
    assert LanguagePreference.objects.get(user__username="alice").chosen == "en"
    assert script_errors == []
