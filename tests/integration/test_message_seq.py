"""Messages are numbered per thread: the API's ids say nothing of other threads or tenants, and a
reader following a thread by its last seen number never misses a message committed after it looked."""

from __future__ import annotations

import random
import threading
import time

import pytest
from django.db import connection, transaction

from chat.models import Message, Thread
from tests.integration.chatting import run_queued
from tests.integration.test_chat import new_thread, say

pytestmark = pytest.mark.django_db


def page(client, thread_id: str, after: int = 0) -> dict:
    response = client.get(f"/api/threads/{thread_id}/messages?after={after}")
    assert response.status_code == 200, response.content
    return response.json()


@pytest.mark.smoke
def test_each_thread_numbers_its_messages_from_one(alice_api, charlie_api):
    busy = new_thread(alice_api)
    for text in ("first", "second"):
        assert say(alice_api, busy, text).status_code == 202
        run_queued()
    other = new_thread(charlie_api)
    assert say(charlie_api, other, "hello").status_code == 202

    assert [m["id"] for m in page(alice_api, busy)["results"]] == [1, 2, 3, 4]
    assert [m["id"] for m in page(charlie_api, other)["results"]] == [1]

    later = page(alice_api, busy, after=2)
    assert (later["results"][0]["id"], later["results"][0]["content"]) == (3, "second")
    assert later["next_after"] == 4
    last = page(alice_api, busy, after=4)
    assert (last["results"], last["next_after"]) == ([], 4)


def test_a_message_makes_its_thread_the_most_recent(alice_api):
    older = new_thread(alice_api, "older")
    new_thread(alice_api, "newer")
    assert say(alice_api, older, "back to this one").status_code == 202
    assert [t["title"] for t in alice_api.get("/api/threads").json()["results"]] == ["older", "newer"]


@pytest.mark.django_db(transaction=True)
def test_a_reader_following_a_thread_sees_every_message_once_while_writers_commit_out_of_order(acme, alice):
    """Writers hold their transaction open for a random moment after taking a number: with a global id,
    a later id could commit first and the reader, moving past it, would never see the earlier one."""
    thread = Thread.objects.create(tenant=acme, owner=alice)
    writers, each = 6, 10

    def write(n: int) -> None:
        rng = random.Random(n)
        try:
            for i in range(each):
                with transaction.atomic():
                    Message.objects.create(thread=thread, role="user", content=f"{n}-{i}", created_at=thread.created_at)
                    time.sleep(rng.uniform(0, 0.01))
        finally:
            connection.close()

    pool = [threading.Thread(target=write, args=(n,)) for n in range(writers)]
    for worker in pool:
        worker.start()
    seen: list[int] = []
    cursor = 0
    deadline = time.monotonic() + 60
    while len(seen) < writers * each and time.monotonic() < deadline:
        batch = list(Message.objects.filter(thread=thread, seq__gt=cursor).order_by("seq").values_list("seq", flat=True))
        seen += batch
        cursor = batch[-1] if batch else cursor
    for worker in pool:
        worker.join()
    seen += list(Message.objects.filter(thread=thread, seq__gt=cursor).order_by("seq").values_list("seq", flat=True))
    assert seen == list(range(1, writers * each + 1))
    thread.refresh_from_db()
    assert thread.message_seq == writers * each
