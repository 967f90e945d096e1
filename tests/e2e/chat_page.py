"""The chat page as tests drive it: signing in, sending, the panel and its rows, and what the server holds."""

from __future__ import annotations

import re
import time

from django.conf import settings
from django.contrib.auth.models import User
from django.test import Client
from django.utils import timezone
from django_q.models import OrmQ
from playwright.sync_api import Locator, Page, expect

from chat.models import Message, Run, Thread
from tasks import actions
from tasks.models import Operation, Task, TaskEvent
from tasks.statuses import TERMINAL, NotificationStatus

IN_DELIVERY = [NotificationStatus.PENDING, NotificationStatus.CLAIMED, NotificationStatus.DISPATCHED]

THREAD_URL = re.compile(r"/t/([0-9a-f-]{36})/$")


def sign_in(page: Page, server: str, username: str) -> None:
    """Sign in through the login form (tests.conftest.make_user's password) and land on the chat page."""
    page.goto(f"{server}/accounts/login/")
    page.get_by_label("Username").fill(username)
    page.get_by_label("Password").fill(f"{username}-password-1")
    page.get_by_role("button", name="Sign in").click()
    expect(page).to_have_url(f"{server}/")


def sign_in_with_cookie(page: Page, server: str, user: User) -> None:
    """Sign in without the form, for tests about something else: on a busy machine each
    password check costs a second or more, in this process and again in daphne."""
    client = Client()
    client.force_login(user)
    name = settings.SESSION_COOKIE_NAME
    page.context.add_cookies([{"name": name, "value": client.cookies[name].value, "url": server}])


def send(page: Page, text: str, *, box_name: str = "Message") -> None:
    """Type a message and press Enter, once the composer may send (`box_name`: the label in the page's language)."""
    expect(page.locator("#send")).to_be_enabled(timeout=15_000)
    box = page.get_by_role("textbox", name=box_name)
    box.fill(text)
    box.press("Enter")


def thread_id_of(page: Page) -> str:
    match = THREAD_URL.search(page.url)
    assert match, f"not on a thread page: {page.url}"
    return match.group(1)


def open_panel(page: Page, *, name: str = "Background tasks") -> Locator:
    panel = page.get_by_role("complementary", name=name)
    if not panel.is_visible():
        page.locator("#panel-toggle").click()
    expect(panel).to_be_visible()
    return panel


def task_row(page: Page, name: str) -> Locator:
    return page.locator(".task-row").filter(has=page.locator(".task-name", has_text=re.compile(f"^{re.escape(name)}$")))


def record_live_labels(page: Page) -> None:
    """Keep every word the timeline's live label shows, from now on: a fast task can finish
    (and its label clear) before an assertion looks, so tests check what was shown instead."""
    page.evaluate("""() => {
        window.liveLabelsShown = [];
        const keep = () => document.querySelectorAll(".live-label").forEach((label) => {
            const word = label.textContent;
            if (word && !window.liveLabelsShown.includes(word)) window.liveLabelsShown.push(word);
        });
        new MutationObserver(keep).observe(document.body, {subtree: true, childList: true, characterData: true});
    }""")


def expect_live_label_shown(page: Page, word: str, *, timeout: float = 10_000) -> None:
    """The live label showed `word` at some point since record_live_labels."""
    page.wait_for_function("(word) => window.liveLabelsShown.includes(word)", arg=word, timeout=timeout)


def assistant_messages(page: Page, containing: str | None = None) -> Locator:
    messages = page.locator("#messages .message.from-assistant")
    return messages.filter(has_text=containing) if containing else messages


def rendered_message_ids(page: Page) -> list[int]:
    return [int(i) for i in page.locator("#messages .message[data-message-id]").evaluate_all(
        "els => els.map(e => e.dataset.messageId)")]


def stored_message_ids(thread_public_id: str) -> list[int]:
    """The visible messages of a thread by their number in it, as GET /api/threads/<id>/messages lists them."""
    return list(Message.objects.filter(thread__public_id=thread_public_id, hidden=False)
                .order_by("seq").values_list("seq", flat=True))


def api_message_ids(page: Page, server: str, thread_public_id: str) -> list[int]:
    """Every message id GET /api/threads/<id>/messages lists, page after page (as the signed-in user)."""
    ids: list[int] = []
    after = 0
    while True:
        body = page.request.get(f"{server}/api/threads/{thread_public_id}/messages?after={after}&limit=100").json()
        ids += [m["id"] for m in body["results"]]
        if len(body["results"]) < 100:
            return ids
        after = body["next_after"]


def api_event_seqs(page: Page, server: str, task_public_id: str) -> list[int]:
    """Every event seq GET /api/tasks/<id>/events lists, page after page."""
    seqs: list[int] = []
    after = 0
    while True:
        body = page.request.get(f"{server}/api/tasks/{task_public_id}/events?after={after}&limit=100").json()
        seqs += [e["seq"] for e in body["results"]]
        if len(body["results"]) < 100:
            return seqs
        after = body["next_after"]


def make_thread(owner: User, title: str) -> Thread:
    return Thread.objects.create(tenant=owner.memberships.get().tenant, owner=owner, title=title)


def start_test_task(thread: Thread, *, steps: int, name: str, **spec: object) -> Task:
    """A debug sleep task in the thread, as the chat agent starts one (1 s steps; `spec` adds
    the driver's other inputs: ask_at_step and question, fail_at_step and fail_kind)."""
    task, _ = actions.submit(tenant=thread.tenant, user=thread.owner, submission=actions.Submission(
        kind="sleep", name=name, input={"steps": steps, "step_seconds": 1, **spec}, thread_id=thread.pk))
    return task


def wait_until(predicate, *, timeout: float, message: str) -> None:
    """Wait for another process (the worker) to make something true; real processes take real time."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout}s waiting for {message}")


def worker_is_busy() -> bool:
    """Anything the worker may still write: a live task, a run, a notification on its way.

    (django-q's queue is no guide: delayed kicks wait in it, with a lock in the future.)"""
    return (Task.objects.exclude(status__in=TERMINAL).exists()
            or Task.objects.filter(notification_status__in=IN_DELIVERY).exists()
            or Run.objects.filter(status__in=[Run.Status.PENDING, Run.Status.RUNNING]).exists())


TASK_FIELDS = ("status", "waiting_reason", "current_step", "fencing_token", "lease_owner", "lease_expires_at",
               "next_run_at", "attempts", "cancel_requested_at", "remote_poll_error", "remote_cancel_attempts",
               "remote_cancel_error", "notification_status", "updated_at")


def where_tasks_stand() -> str:
    """Each unfinished task (or one whose news is still on its way), its last events and its calls, and the
    kicks waiting in the broker: what a failed test's report shows."""
    lines = [f"now {timezone.now().isoformat()}"]
    stuck = Task.objects.exclude(status__in=TERMINAL) | Task.objects.filter(notification_status__in=IN_DELIVERY)
    for task in stuck.order_by("pk"):
        lines.append(f"task {task.pk} {task.name!r}: " + ", ".join(f"{f}={getattr(task, f)!s}" for f in TASK_FIELDS))
        events = TaskEvent.objects.filter(task=task).order_by("-seq")[:12]
        lines.append("  events: " + ", ".join(f"{e.seq}:{e.kind}@{e.at:%H:%M:%S.%f}" for e in reversed(events)))
        for op in Operation.objects.filter(task=task).order_by("-pk")[:8]:
            lines.append(f"  call {op.key} {op.name} {op.status} not_before={op.not_before} started={op.started_at} "
                         f"finished={op.finished_at} lease={op.lease_owner}/{op.lease_expires_at} {op.error_class} "
                         f"{op.error_message[:200]!r}")
    for row in OrmQ.objects.order_by("lock")[:20]:
        lines.append(f"kick {row.key} lock={row.lock} {row.func()}{row.task.get('args')}")
    return "\n".join(lines)


def stop_everything_running(timeout: float = 20) -> None:
    """Cancel what a test left running and wait for the worker to go quiet: emptying the
    database (TRUNCATE) while it writes can deadlock with it."""
    for task in Task.objects.exclude(status__in=TERMINAL):
        try:
            actions.request_cancel(task, user=task.owner, reason="test teardown")
        except Exception:  # it ended meanwhile
            pass
    deadline = time.monotonic() + timeout
    quiet_since = None
    while time.monotonic() < deadline:
        if worker_is_busy():
            quiet_since = None
        elif quiet_since is None:
            quiet_since = time.monotonic()
        elif time.monotonic() - quiet_since > 0.3:  # quiet twice in a row, a moment apart
            return
        time.sleep(0.1)

