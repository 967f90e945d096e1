"""A gateway kick waiting means no job holds the turn, and the calls steps asked for wait for one: a pusher
takes it before the other work due (one job runs the calls of every task waiting, where a step kick serves
one task), and the job that takes the turn withdraws the gateway kicks due then, each of which would run a
job only to be refused the turn. Kicks for later stay, and a job refused the turn withdraws nothing. Beside
them, what every message costs the broker at its end: its acknowledgement is one DELETE."""

from __future__ import annotations

from datetime import timedelta

import psycopg
import pytest
from django.conf import settings
from django.db import connection, connections
from django.test.utils import CaptureQueriesContext
from django_q.conf import Conf
from django_q.models import OrmQ

from tasks import broker, clock, kicks, operations, requested

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.mark.smoke
def test_a_gateway_kick_is_taken_before_the_jobs_and_step_kicks_due_before_it():
    main = broker.Broker(list_key=settings.Q_CLUSTER["name"])
    earlier = [OrmQ.objects.create(key=settings.Q_CLUSTER["name"], payload="a delivery", lock=clock.now()).pk,
               *(kicks.kick("advance", n) for n in range(3))]
    gateway = kicks.kick("operations", 9)

    taken = [pk for pk, _ in main.dequeue()]
    assert taken[0] == gateway, "the gateway kick first"
    assert len(taken) == Conf.BULK and set(taken[1:]) <= set(earlier), "then the others, up to the bulk"
    assert gateway not in [pk for pk, _ in main.dequeue()], "taken once"


def gateway_kicks() -> set[int]:
    return set(OrmQ.objects.filter(key=kicks.queue_of("operations")).values_list("pk", flat=True))


@pytest.mark.skipif("connection.vendor != 'postgresql'", reason="the turn is PostgreSQL's advisory lock")
def test_the_job_that_takes_the_turn_withdraws_the_gateway_kicks_due_and_keeps_those_for_later():
    due = {kicks.kick("operations", n) for n in range(3)}
    later = kicks.kick("operations", 0, at=clock.now() + timedelta(minutes=5))
    other = kicks.kick("advance", 1)

    turn = operations.take_gateway_turn()
    assert turn is not None
    try:
        assert gateway_kicks() == {later}, "the due ones withdrawn, the one for later kept"
        assert OrmQ.objects.filter(pk=other).exists(), "a step kick is not the job's to withdraw"
    finally:
        operations.end_gateway_turn(turn)
    assert due.isdisjoint(gateway_kicks())


@pytest.mark.skipif("connection.vendor != 'postgresql'", reason="the turn is PostgreSQL's advisory lock")
def test_a_job_refused_the_turn_withdraws_nothing():
    due = {kicks.kick("operations", n) for n in range(3)}
    holder = psycopg.connect(requested.conninfo(), autocommit=True)  # another job's, holding the turn
    try:
        holder.execute("SELECT pg_advisory_lock(%s)", [broker.GATEWAY_TURN_KEY])
        assert operations.take_gateway_turn() is None
        assert gateway_kicks() == due
    finally:
        holder.close()


@pytest.mark.smoke
def test_acknowledging_a_message_deletes_its_row_alone_in_one_statement():
    main = broker.Broker(list_key=settings.Q_CLUSTER["name"])
    done, other = kicks.kick("advance", 1), kicks.kick("advance", 2)

    with CaptureQueriesContext(connection) as sent:
        main.acknowledge(done)
    assert [q["sql"].split()[0] for q in sent.captured_queries] == ["DELETE"]
    assert set(OrmQ.objects.values_list("pk", flat=True)) == {other}


def test_a_dequeue_checks_its_connection_once_however_many_rows_it_takes(monkeypatch):
    """django-q2 closes old connections at each use of its broker, and with CONN_HEALTH_CHECKS that costs a
    round trip (SELECT 1) at the next statement: once for the reads, and not again for each row taken."""
    main = broker.Broker(list_key=settings.Q_CLUSTER["name"])
    due = {kicks.kick("advance", n) for n in range(Conf.BULK + 1)}
    orm = connections[Conf.ORM]
    assert orm.health_check_enabled, "settings check connections before use: the cost this test counts"
    checks = []
    is_usable = orm.is_usable
    monkeypatch.setattr(orm, "is_usable", lambda: checks.append(1) or is_usable())

    with CaptureQueriesContext(orm) as sent:
        taken = [pk for pk, _ in main.dequeue()]
    assert len(taken) == Conf.BULK and set(taken) <= due
    assert len(checks) == 1, f"one health check for the dequeue, not one more per row ({len(checks)})"
    assert [q["sql"].split()[0] for q in sent.captured_queries].count("UPDATE") == 1, "one UPDATE takes them all"


@pytest.mark.smoke
def test_a_dequeue_takes_no_row_another_cluster_took_since_it_was_read():
    """Two clusters may read the same due rows: the one whose UPDATE comes second finds their locks moved on."""
    first, second = kicks.kick("advance", 1), kicks.kick("advance", 2)
    read = dict(OrmQ.objects.filter(pk__in=[first, second]).values_list("pk", "lock"))
    until = clock.now() + timedelta(minutes=1)
    assert broker._take([(first, read[first])], until=until) == {first}, "the other cluster takes the first"

    assert broker._take(list(read.items()), until=until + timedelta(seconds=1)) == {second}
    assert OrmQ.objects.get(pk=first).lock == until, "the first keeps the lock the other cluster gave it"
