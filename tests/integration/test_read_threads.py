"""The streams' read threads (tasks/read_threads.py) keep their database connections from one read to the next."""

from __future__ import annotations

import time
from collections.abc import Iterator

import psycopg
import pytest
from django.db import connection, connections

from tasks import requested
from tasks.read_threads import ReadThreads

pytestmark = [pytest.mark.django_db(transaction=True),
              pytest.mark.skipif("connection.vendor != 'postgresql'", reason="reads the server's backend pids")]


def backend_pid() -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        return cursor.fetchone()[0]


@pytest.fixture
def one_thread() -> Iterator[ReadThreads]:
    threads = ReadThreads(1)
    yield threads
    threads.close_connections()


async def test_a_read_thread_keeps_its_connection_whatever_conn_max_age_says(one_thread, monkeypatch):
    """The process's CONN_MAX_AGE is for its request threads, which come and go (the Procfile runs web
    processes with 0); a stream's reads would otherwise each open a connection."""
    monkeypatch.setitem(connections.settings["default"], "CONN_MAX_AGE", 0)
    read = one_thread.to_async(backend_pid)
    assert await read() == await read()


async def test_a_read_whose_connection_the_server_closed_is_read_again_on_a_new_one(one_thread):
    read = one_thread.to_async(backend_pid)
    first = await read()
    with psycopg.connect(requested.conninfo(), autocommit=True) as other:
        other.execute("SELECT pg_terminate_backend(%s)", [first])
        deadline = time.monotonic() + 5
        while other.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s", [first]).fetchone():
            assert time.monotonic() < deadline, "the backend did not end"
            time.sleep(0.02)
    second = await read()
    assert second != first
