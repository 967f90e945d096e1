"""A cluster's pusher waiting on an empty queue takes a kick when it is committed, not at the end of its
poll interval: migration 0025's trigger notifies the kick's key, and the broker waits for its own keys.
A row nothing announces (a kick put off to later, a message whose worker's timeout ran out) ends the wait
when it comes due."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from django.conf import settings
from django.db import connection  # noqa: F401 (the skipif condition reads it)
from django_q.conf import Conf
from django_q.models import OrmQ

from tasks import broker, clock, kicks

pytestmark = [pytest.mark.django_db(transaction=True),  # a kick is heard when it commits
              pytest.mark.skipif("connection.vendor != 'postgresql'", reason="LISTEN/NOTIFY is PostgreSQL's")]
LONG_POLL = 60.0  # longer than any wait below: a wait that ends was ended by a kick


@pytest.fixture
def pusher(monkeypatch):
    """The main cluster's broker, listening already (its first empty wait opens the connection)."""
    main = broker.Broker(list_key=settings.Q_CLUSTER["name"])
    monkeypatch.setattr(Conf, "POLL", 0.01)
    monkeypatch.setattr(broker, "LISTEN_WAIT_SECONDS", 0.01)
    main._wait_for_a_kick()
    assert main._listening is not None, "the broker listens for kicks on PostgreSQL"
    monkeypatch.setattr(Conf, "POLL", LONG_POLL)
    yield main
    main._stop_listening()


def waiting(pusher: broker.Broker) -> threading.Thread:
    thread = threading.Thread(target=pusher._wait_for_a_kick, daemon=True)
    thread.start()
    return thread


def test_a_committed_step_kick_ends_the_pushers_wait_and_is_taken(pusher):
    wait = waiting(pusher)
    kicked = kicks.kick("advance", 1)

    wait.join(timeout=10)
    assert not wait.is_alive(), "the kick's commit woke the pusher"
    assert [pk for pk, _ in pusher.dequeue()] == [kicked]


@pytest.mark.parametrize("other", ["another cluster's job", "a kick put off to later"])
def test_a_kick_that_is_not_the_pushers_to_take_now_does_not_wake_it(pusher, other):
    wait = waiting(pusher)
    if other == "another cluster's job":
        OrmQ.objects.create(key=settings.LONGHAUL_CHAT_QUEUE, payload="x", lock=clock.now())
    else:
        kicks.kick("advance", 1, at=clock.now() + timedelta(minutes=5))

    wait.join(timeout=1.5)
    assert wait.is_alive(), "nothing for this pusher to take: it goes on waiting"
    kicks.kick("advance", 2)  # its own kick ends the wait
    wait.join(timeout=10)
    assert not wait.is_alive()


@pytest.mark.parametrize("later", ["a kick put off to later", "a message whose worker's timeout runs out"])
def test_a_row_that_comes_due_unannounced_ends_the_wait_when_it_is_due(pusher, later):
    due = clock.now() + timedelta(seconds=2)  # beyond the trigger's second of slack: no notification
    if later == "a kick put off to later":
        kicked = kicks.kick("advance", 1, at=due)
    else:  # taken by a worker that died: its lock, moved on by the take, runs out with no commit to say so
        kicked = kicks.kick("advance", 1)
        assert [pk for pk, _ in pusher.dequeue()] == [kicked]
        OrmQ.objects.filter(pk=kicked).update(lock=due)  # sooner than the broker's retry, for the test's sake
        # The kick's own notification (it was due when inserted), heard now so that it cannot end the wait below.
        assert len(list(pusher._listening.notifies(timeout=10, stop_after=1))) == 1
    wait = waiting(pusher)

    wait.join(timeout=10)  # the poll interval is a minute
    assert not wait.is_alive(), "the pusher woke when the row came due"
    assert [pk for pk, _ in pusher.dequeue() or []] == [kicked]
