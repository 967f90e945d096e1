"""The thread page: tenancy, the thread list, the composer's busy state, safe Markdown."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from playwright.sync_api import Page, expect

from chat.models import Message, Run, Thread
from tasks import clock
from tasks.models import Tenant
from tests.conftest import make_user
from tests.e2e.chat_page import assistant_messages, make_thread, send, sign_in_with_cookie

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


def test_it_shows_another_tenants_thread_as_not_found(page: Page, server: str, cheap_passwords):
    alice = make_user("alice", Tenant.objects.create(slug="acme", name="Acme"))
    thread = make_thread(alice, "Acme merger plans")
    Message.objects.create(thread=thread, role="user", content="the secret numbers", created_at=thread.created_at)
    charlie = make_user("charlie", Tenant.objects.create(slug="globex", name="Globex"))
    sign_in_with_cookie(page, server, charlie)

    response = page.goto(f"{server}/t/{thread.public_id}/")

    assert response.status == 404
    # "Nothing here" in production; Django's technical 404 page with DEBUG=1, as in these tests.
    expect(page.get_by_role("heading", name=re.compile(r"Nothing here|Page not found"))).to_be_visible()
    expect(page.locator("body")).not_to_contain_text("the secret numbers")
    expect(page.locator("body")).not_to_contain_text("Acme merger plans")
    for path in ("", "/messages", "/tasks"):
        assert page.request.get(f"{server}/api/threads/{thread.public_id}{path}").status == 404


def test_it_renames_and_deletes_threads_after_confirmation(page: Page, server: str, cheap_passwords):
    alice = make_user("alice", Tenant.objects.create(slug="acme", name="Acme"))
    kept = make_thread(alice, "Heat pumps")
    doomed = make_thread(alice, "Vector databases")
    sign_in_with_cookie(page, server, alice)
    page.goto(f"{server}/t/{kept.public_id}/")
    threads = page.get_by_role("navigation", name="Threads")
    expect(threads.get_by_role("link", name="Heat pumps")).to_have_attribute("aria-current", "page")

    threads.get_by_role("button", name="Rename “Heat pumps”").click()
    title = threads.get_by_role("textbox", name="Thread title")
    expect(title).to_be_focused()
    title.fill("Heat pumps in cold climates")
    title.press("Enter")
    expect(threads.get_by_role("link", name="Heat pumps in cold climates")).to_be_visible()
    expect(page.get_by_role("heading", level=1)).to_have_text("Heat pumps in cold climates")
    expect(page).to_have_title(re.compile(r"^Heat pumps in cold climates · Acme"))
    assert Thread.objects.get(pk=kept.pk).title == "Heat pumps in cold climates"

    # Escape leaves a title as it was.
    threads.get_by_role("button", name="Rename “Vector databases”").click()
    title.fill("Something else")
    title.press("Escape")
    expect(threads.get_by_role("link", name="Vector databases")).to_be_visible()
    assert Thread.objects.get(pk=doomed.pk).title == "Vector databases"

    # Delete asks first; keeping it changes nothing.
    threads.get_by_role("button", name="Delete “Vector databases”").click()
    dialog = page.get_by_role("dialog", name="Delete this thread?")
    expect(dialog).to_be_visible()
    expect(dialog).to_contain_text("“Vector databases”")
    dialog.get_by_role("button", name="Keep it").click()
    expect(dialog).to_be_hidden()
    assert Thread.objects.filter(pk=doomed.pk).exists()

    threads.get_by_role("button", name="Delete “Vector databases”").click()
    dialog.get_by_role("button", name="Delete thread").click()
    expect(threads.get_by_role("link", name="Vector databases")).to_have_count(0)
    assert not Thread.objects.filter(pk=doomed.pk).exists()

    # Deleting the thread on screen leaves for a fresh page.
    threads.get_by_role("button", name="Delete “Heat pumps in cold climates”").click()
    dialog.get_by_role("button", name="Delete thread").click()
    expect(page).to_have_url(f"{server}/")
    expect(page.get_by_text("No threads yet")).to_be_visible()


def test_a_message_sent_from_another_tab_shows_in_this_one(page: Page, server: str, cheap_passwords):
    """The thread's socket tells of its tasks, not of its messages: a page that waits for no reply still
    shows one posted elsewhere (another tab here; a task's notice delivered late) by looking again now and then."""
    alice = make_user("alice", Tenant.objects.create(slug="acme", name="Acme"))
    thread = make_thread(alice, "Two tabs")
    sign_in_with_cookie(page, server, alice)
    page.goto(f"{server}/t/{thread.public_id}/")
    expect(page.get_by_text("No messages yet.")).to_be_visible()
    other = page.context.new_page()
    other.goto(f"{server}/t/{thread.public_id}/")

    send(other, "what is running?")
    expect(assistant_messages(other)).to_have_count(1, timeout=20_000)

    sent = page.locator("#messages .message.from-user .message-text")
    expect(sent).to_have_text(["what is running?"], timeout=30_000)
    expect(assistant_messages(page)).to_have_count(1, timeout=30_000)
    other.close()


def test_it_holds_the_composer_while_the_assistant_is_answering(page: Page, server: str, cheap_passwords):
    alice = make_user("alice", Tenant.objects.create(slug="acme", name="Acme"))
    thread = make_thread(alice, "Heat pumps")
    # A scene: a run of the assistant in progress on some worker (its lease far from expiry).
    now = clock.now()
    run = Run.objects.create(thread=thread, tenant=thread.tenant, status=Run.Status.RUNNING, lease_owner="elsewhere",
                             lease_expires_at=now + timedelta(hours=1), input={"text": "hello"}, created_at=now,
                             started_at=now)
    Message.objects.create(thread=thread, role="user", content="hello", run=run, created_at=now)
    sign_in_with_cookie(page, server, alice)
    page.goto(f"{server}/t/{thread.public_id}/")

    send_button = page.get_by_role("button", name="Send")
    expect(send_button).to_be_disabled()
    expect(page.locator("#composer-status")).to_have_text(re.compile("Longhaul is answering"))
    box = page.get_by_role("textbox", name="Message")
    box.fill("first line")
    box.press("Shift+Enter")
    box.press_sequentially("second line")
    expect(box).to_have_value("first line\nsecond line")  # Shift+Enter is a new line
    box.press("Enter")
    expect(box).to_have_value("first line\nsecond line")  # held while the assistant answers
    assert Message.objects.filter(thread=thread).count() == 1

    # The run ends: its reply shows up and the composer is free again, without a reload.
    Run.objects.filter(pk=run.pk).update(status=Run.Status.SUCCEEDED, finished_at=now, lease_owner="")
    Message.objects.create(thread=thread, role="assistant", content="Hello, *Alice*.", run=run, created_at=now)
    expect(page.locator("#messages .message.from-assistant")).to_have_text(re.compile("Hello, Alice."))
    expect(page.locator("#messages .message.from-assistant em")).to_have_text("Alice")
    expect(send_button).to_be_enabled()
    expect(page.locator("#composer-status")).to_be_hidden()

    box.press("Enter")
    sent = page.locator("#messages .message.from-user:not(.pending) .message-text")
    expect(sent).to_have_text(["hello", "first line\nsecond line"])
    expect(box).to_have_value("")
    assert Message.objects.filter(thread=thread, role="user").last().content == "first line\nsecond line"


MARKDOWN_CASES = r"""async () => {
  const { renderMarkdown } = await import("/static/js/markdown.js");
  const render = (text) => {
    const box = document.createElement("div");
    box.append(renderMarkdown(text, { idPrefix: "m7" }));
    return box;
  };
  const nasty = render([
    "<script>window.__pwned = 1</script><img src=x onerror='window.__pwned = 2'>",
    "[click](javascript:window.__pwned=3) [ok](https://example.org/a_b?x=1&y=2) <https://example.org/raw>",
    '[x" onmouseover="window.__pwned=4](https://example.org/"onmouseover="x)',
    "**bold** *em* `<b>code</b>` \\[9\\] [1]",
    "",
    "```",
    "<script>in code</script>",
    "```",
    "",
    "> quoted",
    "",
    "- one",
    "- two",
    "  1. nested",
    "",
    "## Sources",
    "",
    "[1] A source — https://example.org/1",
  ].join("\n"));
  document.body.append(nasty);
  const elements = [...nasty.querySelectorAll("*")];
  return {
    tags: [...new Set(elements.map((e) => e.localName))].sort(),
    attributes: [...new Set(elements.flatMap((e) => [...e.attributes].map((a) => `${e.localName}.${a.name}`)))].sort(),
    links: [...nasty.querySelectorAll("a")].map((a) => [a.getAttribute("href"), a.textContent, a.rel || null,
                                                       a.target || null]),
    text: nasty.textContent,
    pwned: window.__pwned || null,
  };
}"""


def test_it_renders_markdown_safely(page: Page, server: str):
    page.goto(f"{server}/accounts/login/")

    rendered = page.evaluate(MARKDOWN_CASES)

    assert rendered["pwned"] is None
    assert set(rendered["tags"]) <= {"p", "br", "strong", "em", "code", "pre", "blockquote", "ul", "ol", "li", "a",
                                     "h2", "h3"}
    assert {"strong", "em", "code", "pre", "blockquote", "ul", "ol", "li", "a", "h3"} <= set(rendered["tags"])
    assert not any(a.split(".")[1].startswith("on") or a.endswith(".src") or a.endswith(".style")
                   for a in rendered["attributes"]), rendered["attributes"]
    assert rendered["links"] == [
        ["https://example.org/a_b?x=1&y=2", "ok", "noopener noreferrer", "_blank"],
        ["https://example.org/raw", "https://example.org/raw", "noopener noreferrer", "_blank"],
        # The quotes stay inside the link, percent-encoded: no attribute can be smuggled in.
        ["https://example.org/%22onmouseover=%22x", 'x" onmouseover="window.__pwned=4', "noopener noreferrer",
         "_blank"],
        ["#m7-src-1", "[1]", None, None],
        ["https://example.org/1", "https://example.org/1", "noopener noreferrer", "_blank"],
    ]
    text = rendered["text"]
    assert "<script>window.__pwned = 1</script>" in text  # shown as text, never run
    assert "click ok" in text  # the javascript: link lost its target, not its words
    assert "<b>code</b>" in text and "[9]" in text and "<script>in code</script>" in text
