"""Wake-ups through django-q2. A kick is only a hint: the job re-reads the row and does
nothing if nothing is due, so kicks may be lost or duplicated without harm.

With the ORM broker a kick is a row in the same database: written inside the
transaction that made the work due, it commits or rolls back with it. A delayed
kick is the same row with its `lock` in the future; the broker delivers it then.
Step kicks (`advance`) and gateway kicks (`operations`) go under keys of their own, beside
the cluster's queue (tasks/broker.py), so a worker running steps can ask "does other work
wait?" without counting the hints for tasks it may take from the task table itself, nor
those for calls that the gateway jobs holding every turn have heard of already.

A step kick names its task, or DUE_LONGEST: then it is for whichever task has been due longest
(kick_steps). Work that others carry on (a turn ended, a task handed on, a batch of steps made due) is
kicked so: a worker takes the next in line, a task handed on waits its turn behind those due before it,
and a kick whose task a turn took meanwhile costs a claim that finds nothing and a look for rows other
transactions held, not a look at who holds its task.
"""

from __future__ import annotations

import functools
from datetime import datetime
from typing import Any

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.db import connection, transaction
from django.utils import timezone
from django_q.humanhash import uuid as q_uuid
from django_q.models import OrmQ
from django_q.signing import SignedPackage

from tasks import leases, prepared
from tasks.broker import (
    GATEWAY_GATE_KEY,
    TURN_FREE,
    TURN_FREE_BEHIND_GATE,
    gateway_key,
    gateway_turn_keys,
    jobs_waiting_params,
    jobs_waiting_sql,
    steps_key,
)
from tasks.models import Task
from tasks.typed_sql import typed_param

# The task a step kick names when it is for the task due longest, whichever that is by the time it runs.
DUE_LONGEST = 0

# Job name -> the function a worker runs, by dotted path. Apps built on tasks add theirs
# with register_job at start (chat: "run").
JOBS = {
    "advance": "tasks.jobs.advance",
    "operations": "tasks.jobs.run_operations",
    "deliver": "tasks.jobs.deliver",
}
# Job name -> the django-q2 queue (cluster name) whose workers run it, when not the main one.
QUEUES: dict[str, str] = {}
# Jobs whose kicks are hints for a task due in the task table: the main cluster's step kicks.
STEP_JOBS = frozenset({"advance"})
# Jobs whose kicks are hints for a gateway job: none is needed while jobs hold every turn.
GATEWAY_JOBS = frozenset({"operations"})
def register_job(name: str, dotted_path: str, *, queue: str | None = None) -> None:
    """Let kick(name, ...) run the function at `dotted_path`; called from an AppConfig.ready().
    `queue`: a queue of its own (a cluster in settings.Q_CLUSTER["ALT_CLUSTERS"]), not the main one."""
    if JOBS.setdefault(name, dotted_path) != dotted_path:
        raise ImproperlyConfigured(f"job {name!r} already runs {JOBS[name]}, not {dotted_path}")
    if queue is not None:
        if queue not in settings.Q_CLUSTER.get("ALT_CLUSTERS", {}):
            raise ImproperlyConfigured(f"job {name!r}: no cluster {queue!r} in Q_CLUSTER['ALT_CLUSTERS']")
        QUEUES[name] = queue


def queue_of(job: str) -> str:
    """The broker key a kick of `job` goes to, whichever process kicks it."""
    if job in STEP_JOBS:
        return steps_key(settings.Q_CLUSTER["name"])
    if job in GATEWAY_JOBS:
        return gateway_key(settings.Q_CLUSTER["name"])
    return QUEUES.get(job) or settings.Q_CLUSTER["name"]


def kick(job: str, task_id: int, *, at: datetime | None = None) -> int:
    """Ask a worker to run `job` for the task now, or not before `at`; returns the kick's id."""
    row = _message(job, task_id, at=at, now=timezone.now())
    row.save(force_insert=True)
    return row.pk


def kick_steps(count: int) -> None:
    """Ask `count` workers, now, to run the steps due longest, in one statement. A batch of steps made due
    kicks no more workers than there are (step_workers): each takes the task due longest, goes on to the next
    due (tasks/runner.py) and ends its turn kicking the next in line, so the kicks carry the whole batch."""
    if count > 0:
        now = timezone.now()
        OrmQ.objects.bulk_create([_message("advance", DUE_LONGEST, at=None, now=now) for _ in range(count)])


def step_workers() -> int:
    """How many workers run steps, on every machine (a batch of steps made due kicks as many at most)."""
    return settings.LONGHAUL_STEP_WORKERS


def kick_calls(task_id: int, *, at: datetime) -> None:
    """In the commit that requested the task's calls, due at `at` (inside its transaction): a gateway job for
    them, unless jobs holding every turn will hear them. (A step's statement that stores calls due now and
    commits by itself kicks within it: calls_kick_in_move.)

    Each such job hears the commit (tasks/requested.py), and on its way out, once it has given its turn back,
    it kicks what is left (operations.kick_if_claimable); a kick would only run a job that is refused a turn,
    one per step that asked for calls. So on PostgreSQL a kick for calls due now is put on the queue after
    the commit, by one statement that does nothing while every turn is held: a job seen holding one then gives
    it back after the calls were committed, and its look on the way out finds them. A process that dies
    between the commit and that statement leaves the calls to the sweeper. A kick for later is kicked as
    ever: by then the jobs holding the turns may have ended. SQLite has no turn: its kicks always count."""
    now = timezone.now()
    if connection.vendor != "postgresql" or at > now:
        kick("operations", task_id, at=at)
        return
    row = _message("operations", task_id, at=None, now=now)
    # robust: the step has committed whatever happens here; a kick lost is the sweeper's to make.
    transaction.on_commit(functools.partial(_kick_while_a_turn_is_free, row), robust=True)


def calls_kick_in_move(task_id: int) -> tuple[str, list[Any]]:
    """The gateway kick of a step's statement that stores its calls, due now, and commits by itself (the step's
    move, tasks/transitions.py, whose UPDATE this INSERT ... SELECT reads as `moved`), and its parameters: written
    when the move wins, unless jobs hold every turn. kick_calls looks after the commit, one statement more; this
    look comes before the commit, so a job could give the turn back between the two and miss the calls in its
    last look. The statement holds GATEWAY_GATE_KEY's lock, shared, from before its look until its commit, and a
    job giving the turn back takes that lock alone before its last look (operations.end_gateway_turn): it waits
    for each statement that saw every turn held, and then sees its calls."""
    row = _message("operations", task_id, at=None, now=timezone.now())
    fields = [OrmQ._meta.get_field(name) for name in ("key", "payload", "lock")]
    columns = ", ".join(connection.ops.quote_name(field.column) for field in fields)
    sql = (f"INSERT INTO {connection.ops.quote_name(OrmQ._meta.db_table)} ({columns}) "
           f"SELECT {', '.join(map(typed_param, fields))} "
           f"FROM moved WHERE {TURN_FREE_BEHIND_GATE}")
    return sql, [row.key, row.payload, row.lock, GATEWAY_GATE_KEY, gateway_turn_keys()]


def _kick_while_a_turn_is_free(row: OrmQ) -> None:
    with connection.cursor() as cursor:
        cursor.execute(f"INSERT INTO {OrmQ._meta.db_table} (key, payload, lock) SELECT %s, %s, %s "
                       f"WHERE {TURN_FREE}", [row.key, row.payload, row.lock, gateway_turn_keys()])


def _message(job: str, task_id: int, *, at: datetime | None, now: datetime) -> OrmQ:
    name, message_id = q_uuid()
    package = {
        "id": message_id,
        "name": f"{job}-{task_id}-{name}",
        "func": JOBS[job],
        "args": (task_id,),
        "kwargs": {},
        # Results of kicks are not worth a row each; the task's own events tell the story.
        "save": False,
        "ack_failure": True,
        "started": now,
    }
    return OrmQ(key=queue_of(job), payload=SignedPackage.dumps(package), lock=at if at and at > now else now)


def withdraw(kick_id: int) -> None:
    """Remove a delayed kick no longer needed (a gateway job's lease watchdog, once the job ended well)."""
    OrmQ.objects.filter(pk=kick_id).delete()


def withdraw_gateway_kicks(now: datetime) -> int:
    """Delete the gateway kicks due now; by the job that has just taken the last turn free. They asked for a
    job to run the calls requested, which this one claims next; one was kicked as each step that asked
    committed while a turn was free, and each would run a job only to be refused one. Kicks for later (a
    pool's rate held back, a job's watchdog) stay."""
    return OrmQ.objects.filter(key=queue_of("operations"), lock__lte=now).delete()[0]


def waiting(*, now: datetime, besides: int) -> leases.Waiting:
    """What waits for a worker that has just run a step of task `besides`: one statement. (A claim brings
    the same answer for the task it claims: leases.Resume.waiting.)"""
    postgresql = connection.vendor == "postgresql"
    jobs_sql, jobs_params = jobs_waiting_sql(postgresql=postgresql), jobs_waiting_params(now, postgresql=postgresql)
    if postgresql:
        # Sent at every step a worker runs: prepared, and leases.due() written out as SQL for that.
        steps_sql = f"SELECT 1 FROM {Task._meta.db_table} WHERE {leases.DUE_WHERE} AND id <> %s LIMIT 1"
        steps_params: tuple = (now, now, besides)
    else:
        steps_sql, steps_params = leases.due(now).exclude(pk=besides).values("pk")[:1].query.sql_with_params()
    sql, params = f"SELECT EXISTS({jobs_sql}), EXISTS({steps_sql})", (*jobs_params, *steps_params)
    if postgresql:
        found_jobs, found_steps = prepared.fetchone(sql, params)
    else:
        with connection.cursor() as cursor:
            cursor.execute(sql, params)
            found_jobs, found_steps = cursor.fetchone()
    return leases.Waiting(jobs=bool(found_jobs), steps=bool(found_steps))


def kick_due_longest() -> None:
    """Ask a worker to run the step due longest, now."""
    kick("advance", DUE_LONGEST)


def kick_first_due(*, now: datetime) -> None:
    """Kick for the task due longest, if a task is due that nobody holds. A worker ends its turn with this:
    whatever it left due (the tasks it released without a kick, or another turn's), the worker the kick
    reaches goes on to the rest, so a due task always has a kick or a worker's turn on its way."""
    if leases.due(now).exists():
        kick_due_longest()
