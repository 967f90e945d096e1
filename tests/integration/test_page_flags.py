"""A page and the flag beside it describe one moment: the chat page decides from `busy` whether to fetch
again, and the task panel from `active` how soon. Each test lets a worker commit after each statement of
the read in turn, as one committing meanwhile would, and checks the page against its flag."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext

from chat import runs
from chat.models import Run, Thread
from tasks import actions, clock
from tasks.statuses import TERMINAL
from tests.factories import submit_sleep
from tests.integration.test_chat import new_thread, say

pytestmark = pytest.mark.django_db


class AfterStatement:
    """An execute wrapper: `commit` runs right after the k-th statement (its own statements pass through)."""

    def __init__(self, k: int, commit: Callable[[], object]) -> None:
        self.k, self.commit, self.seen = k, commit, 0

    def __call__(self, execute, sql, params, many, context):
        result = execute(sql, params, many, context)
        self.seen += 1
        if self.seen == self.k:
            self.seen = -1_000_000
            self.commit()
        return result


def each_interleaving(read: Callable[[], dict], commit: Callable[[], object]) -> list[dict]:
    """`read` once with `commit` after each of its statements, each time from the same database state."""
    with CaptureQueriesContext(connection) as counted:
        read()
    pages = []
    for k in range(1, len(counted.captured_queries) + 1):
        sid = transaction.savepoint()
        with connection.execute_wrapper(AfterStatement(k, commit)):
            pages.append(read())
        transaction.savepoint_rollback(sid)
    return pages


def test_a_page_of_messages_without_the_reply_says_the_thread_is_busy(alice_api):
    """The chat page fetches again only while `busy`; a run's end sends nothing on the thread's socket.
    A page without the reply that says not busy would leave the reader waiting for ever."""
    thread_id = new_thread(alice_api)
    assert say(alice_api, thread_id, "what is running?").status_code == 202
    run = Run.objects.get(thread__public_id=thread_id)
    claimed = runs.claim(run.pk, owner="worker-a", now=clock.now())
    assert claimed is not None

    def read() -> dict:
        response = alice_api.get(f"/api/threads/{thread_id}/messages")
        assert response.status_code == 200, response.content
        return response.json()

    pages = each_interleaving(read, lambda: runs.complete(claimed, owner="worker-a", reply="nothing is running",
                                                          data={}, now=clock.now()))
    assert len(pages) >= 3
    for k, page in enumerate(pages, start=1):
        replied = any(m["role"] == "assistant" for m in page["results"])
        assert replied or page["busy"], f"the run ended after statement {k}: no reply, and not busy"


def test_the_panel_lists_each_task_once_and_counts_the_active_ones_it_shows(acme, alice, alice_api):
    thread_id = new_thread(alice_api)
    thread = Thread.objects.get(public_id=thread_id)
    done = submit_sleep(acme, alice, thread_id=thread.pk)
    actions.request_cancel(done, user=alice)
    ending = submit_sleep(acme, alice, thread_id=thread.pk)
    submit_sleep(acme, alice, thread_id=thread.pk)

    def read() -> dict:
        response = alice_api.get(f"/api/threads/{thread_id}/tasks")
        assert response.status_code == 200, response.content
        return response.json()

    pages = each_interleaving(read, lambda: actions.request_cancel(ending, user=alice))
    assert len(pages) >= 2
    for k, page in enumerate(pages, start=1):
        names = [task["id"] for task in page["results"]]
        assert len(names) == len(set(names)) == 3, f"the task ended after statement {k}: listed {names}"
        shown_active = sum(task["status"] not in TERMINAL for task in page["results"])
        assert page["active"] == shown_active, f"the task ended after statement {k}"
