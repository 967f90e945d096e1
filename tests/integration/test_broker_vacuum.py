"""The broker's table is vacuumed by the monitor that acknowledges its messages, once every VACUUM_EVERY of them.

Every message leaves two dead rows there (its dequeue's UPDATE, its acknowledgement's DELETE), and every step
reads the table (a claim's and a step's look at what else waits). Left to autovacuum, which passes at most once
a minute, a steady flow of kicks bloated it to thousands of dead rows around a few dozen live ones."""

from __future__ import annotations

import pytest
from django.conf import settings
from django.db import connection, transaction
from django_q.models import OrmQ

from tasks import broker, checks, clock

pytestmark = [pytest.mark.django_db(transaction=True),  # VACUUM cannot run inside a transaction
              pytest.mark.skipif("connection.vendor != 'postgresql'", reason="SQLite has no VACUUM of a table")]


def vacuums() -> int:
    """How many times the broker's table was vacuumed by hand (autovacuum's passes are counted apart)."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT vacuum_count FROM pg_stat_user_tables WHERE relname = %s", [OrmQ._meta.db_table])
        return cursor.fetchone()[0]


def acknowledge(monitor: broker.Broker, count: int) -> None:
    """`count` messages put on the queue and acknowledged, one after another, as a monitor does."""
    for _ in range(count):
        message = OrmQ.objects.create(key=monitor.list_key, payload="x", lock=clock.now())
        monitor.acknowledge(message.pk)


@pytest.fixture
def monitor() -> broker.Broker:
    return broker.Broker(list_key=settings.Q_CLUSTER["name"])


def test_the_table_is_vacuumed_once_every_vacuum_every_acknowledgements(monitor):
    before = vacuums()

    acknowledge(monitor, broker.VACUUM_EVERY - 1)
    assert vacuums() == before, "no vacuum before VACUUM_EVERY acknowledgements"
    acknowledge(monitor, 1)
    assert vacuums() == before + 1
    acknowledge(monitor, broker.VACUUM_EVERY)
    assert vacuums() == before + 2
    assert not OrmQ.objects.exists(), "every acknowledged message was deleted"


def test_an_acknowledgement_inside_a_transaction_deletes_its_message_and_vacuums_nothing(monitor, monkeypatch):
    monkeypatch.setattr(broker, "VACUUM_EVERY", 1)
    before = vacuums()

    with transaction.atomic():
        acknowledge(monitor, 1)
    assert not OrmQ.objects.exists()
    assert vacuums() == before, "VACUUM cannot run in a transaction: that acknowledgement skips it"
    acknowledge(monitor, 1)
    assert vacuums() == before + 1


def superuser() -> bool:
    with connection.cursor() as cursor:
        cursor.execute("SELECT rolsuper FROM pg_roles WHERE rolname = current_user")
        return cursor.fetchone()[0]


def test_the_role_that_ran_the_migrations_may_vacuum_the_table_and_the_check_says_nothing():
    with connection.cursor() as cursor:
        assert broker.may_vacuum(cursor, OrmQ._meta.db_table)
    assert checks.broker_table_vacuumed(databases=["default"]) == []
    assert checks.broker_table_vacuumed(databases=None) == []  # not asked for a database: reads none


def test_a_table_not_there_yet_is_no_answer_not_an_error():
    # `manage.py migrate` runs the database checks before it creates the tables.
    with connection.cursor() as cursor:
        assert broker.may_vacuum(cursor, "no_such_table") is None


def test_a_role_that_may_not_vacuum_the_table_is_told_once_and_vacuums_nothing(monitor, monkeypatch, caplog):
    if superuser():
        pytest.skip("a superuser may vacuum every table")
    # pg_database is shared by every database: only a superuser may vacuum it, not this database's owner.
    with connection.cursor() as cursor:
        assert not broker.may_vacuum(cursor, "pg_database")
    asked = broker.may_vacuum
    monkeypatch.setattr(broker, "may_vacuum", lambda cursor, table: asked(cursor, "pg_database"))
    before = vacuums()

    acknowledge(monitor, 2 * broker.VACUUM_EVERY)
    assert vacuums() == before
    told = (f"broker: the database role may not vacuum {OrmQ._meta.db_table}, which is left to autovacuum "
            "(manage.py check --database default: longhaul.W004)")
    assert [r.getMessage() for r in caplog.records if "may not vacuum" in r.getMessage()] == [told]
