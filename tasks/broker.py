"""django-q2's ORM broker, reading a cluster's own queue and the step kicks beside it.

Kicks to run a task's next step (`advance`) go under a key of their own (`<cluster>:steps`),
and so do kicks for a gateway job (`<cluster>:gateway`); the same cluster's workers take both
as before. Only what sits under the cluster's own
key is work a worker running steps should make way for (a delivery, a sweep): a step kick
is only a hint for a task that is due in the task table, where a worker that is already
running steps takes it straight away (tasks/runner.py), and a gateway kick is only a hint
while gateway jobs hold every turn, which hear the calls requested (tasks/requested.py).
Keeping them apart is what lets the runner's probe tell them apart in one indexed query.

On PostgreSQL the pusher, when its queue is empty, waits for a kick instead of sleeping: the statement
trigger of migration 0025 notifies CHANNEL when a commit puts a job on the table due now, so a task
submitted to an idle cluster starts at once rather than up to a poll interval later. No commit announces
a row that comes due later (a delayed kick, a message whose worker's timeout runs out), so the wait ends
when the first of those is due, and after LISTEN_WAIT_SECONDS at most: a notification is only a hint, and
one lost costs that long. Waiting instead of polling is what keeps an idle cluster idle (20 dequeues a
second at django-q2's 0.05 s poll cost about 5% of a core per cluster, and the database as much again).
A pusher that cannot listen sleeps the poll interval, as django-q2's does.

The monitor that acknowledges messages also vacuums the table, once every VACUUM_EVERY of them: a queue table
turns over its rows every few seconds, far faster than autovacuum passes (Broker._vacuum).
"""

from __future__ import annotations

import contextlib
import logging
import zlib
from datetime import datetime
from functools import lru_cache
from time import monotonic, sleep
from typing import Any

from django.conf import settings
from django.db import DatabaseError, connections
from django.db.models import QuerySet
from django.utils import timezone
from django_q.brokers import get_broker
from django_q.brokers.orm import ORM
from django_q.conf import Conf
from django_q.models import OrmQ

from tasks.compiled import compiled_once

log = logging.getLogger(__name__)
CHANNEL = "longhaul_kicks"
STEPS_SUFFIX = ":steps"
GATEWAY_SUFFIX = ":gateway"
LISTEN_WAIT_SECONDS = 1.0  # the longest a listening pusher waits on an empty queue (unless POLL is longer)
DUE_MARGIN_SECONDS = 0.01  # a wait's timeout may end a millisecond early: wake once the row is due, not just before
VACUUM_EVERY = 100  # messages a monitor acknowledges between two vacuums of the broker's table (Broker._vacuum)
# The session advisory locks gateway jobs hold while they claim calls (tasks/operations.py): one per turn, the
# first LONGHAUL_GATEWAY_TURNS keys from this one (all below 2**32, so each is pg_locks' objid with classid 0).
GATEWAY_TURN_KEY = zlib.crc32(b"longhaul-gateway-turn")
# While gateway jobs hold every turn (PostgreSQL's advisory locks, which pg_locks lists), they hear the calls
# steps request: their gateway kicks are only hints. While a turn is free, a kick starts a job that takes it.
# SQLite has no such lock; a gateway kick always counts. Its parameter: gateway_turn_keys().
TURN_FREE = ("EXISTS (SELECT 1 FROM unnest(%s::bigint[]) AS turn (key) WHERE NOT EXISTS (SELECT 1 FROM pg_locks "
             "WHERE locktype = 'advisory' AND classid = 0 AND objid::bigint = turn.key AND objsubid = 1 AND granted "
             # Advisory locks are the server's: another database's gateway jobs hold other turns.
             "AND database = (SELECT oid FROM pg_database WHERE datname = current_database())))")
# A step's statement that stores calls looks at the turn before it commits: it holds this key's lock, shared, from
# before that look until its commit, and a job giving the turn back takes it alone, so waits for such statements
# (operations.end_gateway_turn). Its parameters: GATEWAY_GATE_KEY, gateway_turn_keys(). CASE takes the lock before
# it looks: PostgreSQL runs the look at pg_locks (an InitPlan) when the result first needs it.
GATEWAY_GATE_KEY = zlib.crc32(b"longhaul-gateway-gate")
TURN_FREE_BEHIND_GATE = f"CASE WHEN pg_advisory_xact_lock_shared(%s) IS NOT NULL THEN {TURN_FREE} END"


def gateway_turn_keys() -> list[int]:
    """The advisory lock keys of the gateway's turns (LONGHAUL_GATEWAY_TURNS of them)."""
    return [GATEWAY_TURN_KEY + n for n in range(settings.LONGHAUL_GATEWAY_TURNS)]


def steps_key(cluster: str) -> str:
    """The broker key of `cluster`'s step kicks."""
    return f"{cluster}{STEPS_SUFFIX}"


def gateway_key(cluster: str) -> str:
    """The broker key of `cluster`'s gateway kicks."""
    return f"{cluster}{GATEWAY_SUFFIX}"


@lru_cache(maxsize=1)
def own_queue() -> str:
    """The queue this process's cluster takes work from."""
    return get_broker().list_key


# The pusher's reads at every dequeue, compiled once (tasks/compiled.py). The cluster's ORM database is the
# default one (settings.Q_CLUSTER["orm"]), the connection compiled reads use.
@compiled_once
def _gateway_kick(*, gateway: str, now: datetime) -> QuerySet:
    return OrmQ.objects.filter(key=gateway, lock__lt=now).values_list("pk", "payload", "lock")[:1]


@compiled_once
def _due_rows(*, queue: str, steps: str, gateway: str, now: datetime) -> QuerySet:
    return (OrmQ.objects.filter(key__in=[queue, steps, gateway], lock__lt=now)
            .values_list("pk", "payload", "lock")[:Conf.BULK])


def _take(rows: list[tuple[int, datetime]], *, until: datetime) -> set[int]:
    """Of `rows` (id, lock as read), those whose lock is still as read, now locked `until`: the ids of the rows
    this pusher takes. ORM.dequeue's update() of each row, as one statement for them all, written out: the
    pusher sends it for every message, and building the ORM's UPDATE cost it more CPU than the database spent
    running it (0.31 ms a row against 0.11 written out, measured here)."""
    db = connections[Conf.ORM]
    qn, adapt = db.ops.quote_name, db.ops.adapt_datetimefield_value
    pk, lock = (qn(OrmQ._meta.get_field(name).column) for name in ("id", "lock"))
    matches = " OR ".join([f"({pk} = %s AND {lock} = %s)"] * len(rows))
    with db.cursor() as cursor:
        cursor.execute(f"UPDATE {qn(OrmQ._meta.db_table)} SET {lock} = %s WHERE {matches} RETURNING {pk}",
                       [adapt(until), *(value for row_id, read in rows for value in (row_id, adapt(read)))])
        return {row_id for (row_id,) in cursor.fetchall()}


def jobs_waiting_sql(*, postgresql: bool) -> str:
    """A query with a row when work a worker running steps should make way for is due: a job under this
    cluster's own key (a delivery, a sweep), or a gateway kick while a turn is free (no job holding one would
    hear it). One pass over the broker's rows for both keys (the turns are looked up once, if a gateway kick
    waits). Its
    parameters: jobs_waiting_params()."""
    turn_free = TURN_FREE if postgresql else "1 = 1"
    return (f"SELECT 1 FROM {OrmQ._meta.db_table} WHERE lock <= %s "
            f"AND (key = %s OR (key = %s AND {turn_free})) LIMIT 1")


def jobs_waiting_params(now: datetime, *, postgresql: bool) -> tuple:
    queue = own_queue()
    return (now, queue, gateway_key(queue), *((gateway_turn_keys(),) if postgresql else ()))


def may_vacuum(cursor: Any, table: str) -> bool | None:
    """Whether the session's role may VACUUM `table` (PostgreSQL): a superuser, or a member of the role that owns
    it, or of the database's owner unless the table is shared by every database (a catalog). None: no such
    table (yet: a database check runs before the migrations)."""
    cursor.execute(
        "SELECT r.rolsuper OR pg_has_role(c.relowner, 'USAGE') OR (NOT c.relisshared AND pg_has_role(d.datdba, "
        "'USAGE')) FROM pg_class c, pg_database d, pg_roles r WHERE c.oid = to_regclass(%s) "
        "AND d.datname = current_database() AND r.rolname = current_user", [table])
    row = cursor.fetchone()
    return None if row is None else bool(row[0])


class Broker(ORM):
    """The ORM broker over three keys: the cluster's queue, its step kicks and its gateway kicks."""

    _listening: Any = None  # the pusher's own connection, LISTENing on CHANNEL; None until its queue is empty
    _warned = False  # the log said listening failed, and it has not worked since
    _deleted = 0  # messages this process deleted since it last vacuumed the table
    _may_vacuum: bool | None = None  # whether the database role may vacuum the table; None until first asked

    @property
    def keys(self) -> tuple[str, str, str]:
        return self.list_key, steps_key(self.list_key), gateway_key(self.list_key)

    def queue_size(self) -> int:
        return self.get_connection().filter(key__in=self.keys, lock__lte=timezone.now()).count()

    def lock_size(self) -> int:
        return self.get_connection().filter(key__in=self.keys, lock__gt=timezone.now()).count()

    def purge_queue(self):
        return self.get_connection().filter(key__in=self.keys).delete()

    def dequeue(self):
        # ORM.dequeue, over its keys, in no order (as there: an ORDER BY would sort every due row each poll) but
        # for a gateway kick, taken first: the job it starts runs the calls of every task waiting for one, where
        # a step kick serves one task. A due gateway kick means a turn is free (the job that takes the last one
        # withdraws them: operations.take_gateway_turn), and taken in no order it waited behind the step kicks,
        # seconds in a wave of them, while the calls the steps asked for waited for a job.
        queue, steps, gateway = self.keys
        now = timezone.now()
        # As ORM.dequeue, old connections are closed first, but once: ORM.dequeue does it again for each row it
        # takes, and with CONN_HEALTH_CHECKS each time costs a SELECT 1 before the row's UPDATE.
        self.get_connection()
        rows = _gateway_kick(gateway=gateway, now=now)
        rows += [row for row in _due_rows(queue=queue, steps=steps, gateway=gateway, now=now) if row not in rows]
        rows = rows[:Conf.BULK]
        # Another cluster may have been faster on a row: then its lock moved on, and this takes nothing.
        won = _take([(pk, lock) for pk, _, lock in rows], until=self.timeout(None)) if rows else set()
        taken = [(pk, payload) for pk, payload, _ in rows if pk in won]
        if taken:
            return taken
        if not rows:
            self._wait_for_a_kick()  # an empty queue: spare the CPU, as ORM.dequeue does
        return None

    def delete(self, task_id: int) -> None:
        # What the monitor's acknowledgement of every message comes to (ORM.acknowledge, ORM.fail). ORM.delete
        # runs QuerySet.delete(): a Collector and a transaction of its own, for a row nothing refers to; one
        # DELETE does it (0.39 ms where that took 0.83 here), once per message, kicks that find their task
        # already taken included.
        self.get_connection()  # as ORM: old connections closed first
        with connections[Conf.ORM].cursor() as cursor:
            cursor.execute(f"DELETE FROM {OrmQ._meta.db_table} WHERE id = %s", [task_id])
        self._deleted += 1
        if self._deleted >= VACUUM_EVERY:
            self._deleted = 0
            self._vacuum()

    def _vacuum(self) -> None:
        """VACUUM the broker's table, which every message leaves two dead rows in (its dequeue's UPDATE, its
        acknowledgement's DELETE). Every step reads it (a claim's and a step's look at what else waits), and
        with autovacuum's pass at most once a minute, a steady flow of kicks left it holding thousands of dead
        rows for a few dozen live ones: each look read the whole bloated table (a sequential scan: the table's
        statistics say it is nearly empty, as it is of live rows). Measured with 200 research tasks in flight
        (bench/inflight_steady.py, pg_stat_statements): a claim took 2.27 ms and 612 buffers, and 0.41 ms and
        108 with this vacuum. SKIP_LOCKED: another monitor's vacuum, or autovacuum's, does the work instead."""
        connection = connections[Conf.ORM]
        if connection.vendor != "postgresql" or connection.in_atomic_block:
            return  # SQLite reuses a deleted row's space by itself; VACUUM cannot run inside a transaction
        table = OrmQ._meta.db_table
        try:
            with connection.cursor() as cursor:
                if self._may_vacuum is None:
                    self._may_vacuum = may_vacuum(cursor, table) is not False
                    if not self._may_vacuum:  # PostgreSQL would skip it with a warning, every time: said once here
                        log.warning("broker: the database role may not vacuum %s, which is left to autovacuum "
                                    "(manage.py check --database default: longhaul.W004)", table)
                if self._may_vacuum:
                    cursor.execute(f"VACUUM (SKIP_LOCKED) {connection.ops.quote_name(table)}")
        except DatabaseError as exc:  # the acknowledgement stands; the next vacuum will try again
            log.warning("broker: could not vacuum its table (%s)", exc)

    def _wait_for_a_kick(self) -> None:
        """Until a kick is committed (PostgreSQL), or the poll interval has passed."""
        import psycopg

        from tasks.requested import conninfo

        try:
            if self._listening is None or self._listening.closed:
                where = conninfo()
                if where is None:  # SQLite: nothing to listen to
                    sleep(Conf.POLL)
                    return
                self._listening = psycopg.connect(where, autocommit=True)
                self._listening.execute(f"LISTEN {CHANNEL}")
            # Notifications that came while the pusher was busy are kept by the connection: the wait then
            # ends at once, and the next dequeue finds the job or (already taken) nothing.
            deadline = monotonic() + self._until_next_due()
            while (left := deadline - monotonic()) > 0:
                heard = [n.payload for n in self._listening.notifies(timeout=left, stop_after=1)]
                if any(key in self.keys for key in heard):  # another cluster's kick is not this pusher's
                    break
            self._warned = False
        except (psycopg.Error, OSError) as exc:
            if not self._warned:  # once per loss, not on every poll while the database is away
                log.warning("broker: not listening for kicks (%s); polling every %s s", exc, Conf.POLL)
                self._warned = True
            self._stop_listening()
            sleep(Conf.POLL)

    def _until_next_due(self) -> float:
        """Seconds until the first row of this pusher's keys comes due, within [0, the longest wait].

        Asked on the listening connection: one a firewall dropped while it only listened fails here (and is
        opened again) rather than leaving every kick to wait out the longest wait in silence."""
        longest = max(Conf.POLL, LISTEN_WAIT_SECONDS)
        # Each key's first lock off the (key, lock) index, a row each: a MIN over `key IN (...)` would read them all.
        first = self._listening.execute(
            f"SELECT min((SELECT lock FROM {OrmQ._meta.db_table} WHERE key = k ORDER BY lock LIMIT 1)) "
            "FROM unnest(%s::text[]) AS k", [list(self.keys)]).fetchone()[0]
        if first is None:
            return longest
        return min(longest, max(0.0, (first - timezone.now()).total_seconds() + DUE_MARGIN_SECONDS))

    def _stop_listening(self) -> None:
        if self._listening is not None:
            with contextlib.suppress(Exception):  # closing a broken connection: nothing left to save
                self._listening.close()
            self._listening = None
