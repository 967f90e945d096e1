"""A cluster's pusher waiting on an empty queue takes a kick when it is committed, not at the end of its
poll interval: migration 0025's trigger notifies the kick's key, and the broker waits for its own keys."""

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
