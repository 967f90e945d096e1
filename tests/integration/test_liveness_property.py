"""Nothing is ever stranded (DESIGN §4 "Liveness"), as a Hypothesis state machine on real PostgreSQL.

The machine drives the runtime in-process, as workers, gateways and users would, through random
sequences of: submissions (sleep, research on the offline provider, remote MCP tools), user
actions (cancel, pause, resume with more budget, answer, delete a task or a thread), the broker delivering, losing or
duplicating a kick, gateway batches that run or die, workers that claim a step and die (and may
wake up later as zombies), the clock moving, the sweeper, and chat faults (deleted threads, busy
threads, failing notification runs, notifiers and chat workers that die).

How it is driven:
- time: one time-machine traveller per example, frozen (tick=False) and moved only by rules;
  tasks/clock.py reads it, and so do the broker's due times below.
- broker: kicks are OrmQ rows (tasks/kicks.py). A rule takes a due row (lock <= now), decodes
  it and calls its function here; another deletes one unrun; another runs one and leaves it.
- gateway: operations.run_due in-process, or operations.claim_batch by an owner that never
  records (its lease must expire); another process's gateway job holding the turn is a second session
  holding its advisory lock, which gives it back (kicking what is left, as a job does) or dies.

After every rule: nothing is stranded (this module's own reading of the rule, and
tasks/liveness.find_violations once the sweeper has run), event seqs are gapless, checkpoints
are counted steps written by ever newer claims, no effect ran twice, each notification version
was told at most once, attempt counters stay bounded, and terminal tasks stay terminal. A worker
that was fenced out writes nothing when it wakes up. At the end of every example a drain runs the
broker, the gateway, the sweeper and the clock (answering and resuming nothing) until nothing
moves; then every task is terminal or waits for a person, every task its owner deleted is gone, every notification is delivered,
dead-lettered with an alert, or none, every chat run has ended, and no call outlives its task.

LONGHAUL_PROPERTY_EXAMPLES=N runs more examples; LONGHAUL_PROPERTY_RANDOM=1 explores new ones
(by default the same examples run every time, so a red build means a change broke something).
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx2._transports.default as httpx2_transports
import psycopg
import pytest
import time_machine
from django.conf import settings as django_settings
from django.db import connection, transaction
from django.utils.module_loading import import_string
from django_q.models import OrmQ
from django_q.signing import SignedPackage
from hypothesis import HealthCheck
from hypothesis import event as hypothesis_event
from hypothesis import settings as hsettings
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

import chat.agent
from chat import deletion as chat_deletion
from chat import jobs as chat_jobs
from chat import runs
from chat.models import Message, Run, Thread, ThreadItem
from chat.streams import STATUS_CHANGE_KINDS, number_new_items
from tasks import (
    actions,
    broker,
    clock,
    deletion,
    gateway_thread,
    kicks,
    leases,
    notifications,
    operations,
    requested,
    runner,
    scheduling,
    sweeper,
)
from tasks.errors import Conflict, RateLimited
from tasks.models import (
    Alert,
    AuditEntry,
    Checkpoint,
    IdempotencyRecord,
    Operation,
    Pool,
    SleepEffect,
    Task,
    TaskEvent,
    Tenant,
)
from tasks.statuses import ACTIVE, CLAIMABLE, HOLDS_SLOT, TERMINAL, NotificationStatus, OperationStatus, TaskStatus
from tests.fakes.mcp_task_server import SERVER_NAME, McpTaskServer, write_servers_file
from tests.fakes.openai_server import FakeOpenAI, Reply, Status, research_reply

try:  # tasks/liveness.py is the runtime's own check; this module keeps its independent one too
    from tasks import liveness
except ImportError:  # pragma: no cover - before tasks/liveness.py existed
    liveness = None

S = TaskStatus
N = NotificationStatus
pytestmark = [pytest.mark.django_db(transaction=True),
              pytest.mark.skipif("connection.vendor != 'postgresql'",
                                 reason="the records' invariants are one query in PostgreSQL's SQL (CONSISTENCY_SQL)")]

# 150 examples take 1.5 minutes on a quiet 2-core machine and 4 to 5 on a contended one (with the two-turn run, a
# third of the suite's wall time there): make test's budget.
EXAMPLES = int(os.environ.get("LONGHAUL_PROPERTY_EXAMPLES", "150"))
GATEWAY_RUN_FOR = 2.0  # the slice of the gateway jobs the machine runs itself, in seconds
TURNS_EXAMPLES = max(1, EXAMPLES // 3)  # the same machine with two gateway turns: what differs is the kicks' condition
STEPS = int(os.environ.get("LONGHAUL_PROPERTY_STEPS", "15"))
SYSTEM_CAP = 4  # LONGHAUL_MAX_RUNNING at the start of each example (a rule changes it)
EXPLORE = os.environ.get("LONGHAUL_PROPERTY_RANDOM") == "1"
START = datetime(2031, 3, 1, 12, 0, tzinfo=UTC)
MAX_TASKS = 5
MAX_REMOTE_TASKS = 2  # MCP calls are the slowest part of an example
PERSON = frozenset({S.WAITING_INPUT, S.PAUSED, S.PARTIAL})
PAUSABLE = (S.QUEUED, S.RUNNING, S.RETRY_WAIT, S.WAITING_INPUT, S.WAITING_TOOL)
SETTLED_NOTIFICATIONS = frozenset({N.NONE, N.DELIVERED, N.DEAD_LETTER})
ACTIVE_RUN = (Run.Status.PENDING, Run.Status.RUNNING)
UNFINISHED_OPS = (OperationStatus.PENDING, OperationStatus.STARTED)
# Dead letters that are not counted run failures: the thread is gone, or stayed busy past the ceiling.
NOT_RUN_FAILURES = ("the thread was deleted", "the thread stayed busy")
# The call that stops a task's remote work: it runs whatever became of the task.
STOPS_REMOTE_WORK = ("mcp", "tasks/cancel")
# How tasks/liveness.py words the repair of rule operation_orphaned.
ORPHAN_CLOSED = re.compile(r"operation (?P<key>\S+) \(.*\) outlived its task; closed")
# Real seconds a drain may wait for remote MCP tasks, which run on the wall clock.
DRAIN_REAL_SECONDS = 15.0
DRAIN_ROUNDS = 2000
# The drain sweeps less often than the real schedule (once a minute): slower recovery, same recovery.
SWEEP_EVERY = timedelta(minutes=3)
# Sweeps in a row that find nothing to do before a drain stops: longer than every lease, watch and grace
# period the runtime waits out before it retries or repairs a row (the longest: a dispatched
# notification is looked at again after 10 minutes).
QUIET_SWEEPS = 4


# --- the world each example starts from ------------------------------------------------------------

RUNTIME_TABLES = [ThreadItem, Message, Run, Alert, SleepEffect, IdempotencyRecord, Operation, Checkpoint, TaskEvent, Task,
                  Thread, AuditEntry, OrmQ, Pool]


def reset_tables() -> None:
    """Every example starts from an empty runtime; tenants and users stay. One transaction: the
    foreign keys are checked at its end."""
    with transaction.atomic(), connection.cursor() as cursor:
        for model in RUNTIME_TABLES:
            cursor.execute(f"DELETE FROM {connection.ops.quote_name(model._meta.db_table)}")


class Faults:
    """What the rules switch on, and what the patched runtime counts."""

    def __init__(self) -> None:
        self.chat_failures_left = 0
        self.executions: Counter[str] = Counter()

    def reset(self) -> None:
        self.chat_failures_left = 0
        self.executions.clear()


FAULTS = Faults()


class Meanwhile:
    """Concurrency: an action armed for a point in the runtime (a worker between its step and its commit,
    a delivery between starting its run and recording it, a chat turn, a gateway call, a worker that
    has just claimed) runs there on another thread, so on another database connection, the way another
    process would. The hooked code waits for it; if the action blocks on a row lock the hooked code
    holds, the hooked code goes on and the action finishes after (joined before the invariants)."""

    POINTS = ("claimed", "step", "call", "delivery", "chat turn")
    WAIT = 2.0

    def __init__(self) -> None:
        self.armed: dict[str, Any] = {}
        self.running: list[threading.Thread] = []
        self.errors: list[BaseException] = []

    def reset(self) -> None:
        self.settle()
        self.armed.clear()

    def arm(self, point: str, action: Any) -> None:
        self.armed[point] = action

    def reached(self, point: str) -> None:
        action = self.armed.pop(point, None)
        if action is None:
            return
        thread = threading.Thread(target=self._run, args=(action,), name=f"meanwhile-{point}", daemon=True)
        thread.start()
        thread.join(self.WAIT)
        if thread.is_alive():
            self.running.append(thread)

    def _run(self, action: Any) -> None:
        try:
            action()
        except BaseException as exc:  # re-raised on the test's thread by settle()
            self.errors.append(exc)
        finally:
            connection.close()

    def settle(self) -> None:
        running, self.running = self.running, []
        for thread in running:
            thread.join(60)
            assert not thread.is_alive(), f"{thread.name} is still running after a minute"
        if self.errors:
            error, self.errors = self.errors[0], []
            raise error


MEANWHILE = Meanwhile()
# What the examples reached (printed with -s): final statuses, repairs, fenced-out zombies.
REACHED: Counter[str] = Counter()


def event(what: str) -> None:
    if currently_in_test_context():  # the regression tests below replay rules outside Hypothesis
        hypothesis_event(what)
    REACHED[what] += 1


class RemoteCalls:
    """Tool calls the fake MCP server received, per task (each submission carries a unique tag).
    Reads only the task records written since the last look."""

    def __init__(self, state_dir: Path) -> None:
        self.tasks_dir = state_dir / "tasks"
        self.seen: set[str] = set()
        self.per_tag: Counter[str] = Counter()

    def duplicates(self) -> list[str]:
        for path in self.tasks_dir.glob("*.json"):
            if path.name in self.seen:
                continue
            try:
                tag = json.loads(path.read_text())["args"].get("tag")
            except (OSError, ValueError, KeyError):
                continue  # being written; read it next time
            self.seen.add(path.name)
            if tag:
                self.per_tag[tag] += 1
        return [f"the remote tool was called {n} times for one task ({tag})" for tag, n in self.per_tag.items()
                if n > 1]


@pytest.fixture(scope="module")
def mcp_server(tmp_path_factory) -> Iterator[tuple[Any, Path]]:
    state = tmp_path_factory.mktemp("mcp-state")
    with McpTaskServer(transport="http", state_dir=state) as server:
        yield server, state


@pytest.fixture(scope="module")
def model_server() -> Iterator[FakeOpenAI]:
    with FakeOpenAI(default=MODEL_ANSWERS["answers"]) as server:
        yield server


# What the OpenAI-compatible fake does, by the machine's choice (research_reply answers each purpose in kind).
MODEL_ANSWERS = {
    "answers": Reply(content=research_reply),
    "fails": Status(500),
    "answers malformed": Reply(content="this is not the JSON you asked for"),
    # Pauses the model's pool (tasks/pools.py): its calls wait for the pause, on their tasks' retry budgets.
    "rate-limits": Status(429, headers={"Retry-After": "20"}),
}


class AdmissionsGivenUp(logging.Handler):
    """What scheduling.admit logs when it stops with slots still being taken back, which it never should."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


ADMISSIONS_GIVEN_UP = AdmissionsGivenUp()


@pytest.fixture
def world(acme, globex, alice, bob, charlie, settings, tmp_path, mcp_server, model_server,
          monkeypatch) -> Iterator[dict]:
    """Small running caps (so admission matters), fast remote polls, the MCP fake, the fault switches."""
    acme.max_running = 2
    acme.save()
    globex.max_running = 3
    globex.save()
    settings.LONGHAUL_STEP_SLICE_MS = 0  # one step per advance: more interleavings
    settings.LONGHAUL_MAX_RUNNING = SYSTEM_CAP
    settings.LONGHAUL_CHAT_RUNS_PER_TENANT = 1  # chat runs wait for admission too, and must still all end
    settings.LONGHAUL_MCP_POLL_FLOOR_MS = 50
    settings.LONGHAUL_MCP_BACKOFF_CAP_SECONDS = 0.4
    settings.LONGHAUL_MCP_CANCEL_CONFIRM_SECONDS = 5
    # Searches are rate-limited: a pool held back by its rate must still get its calls run.
    settings.LONGHAUL_POOLS = {"tool:search": {"requests_per_minute": 30}}
    settings.LONGHAUL_TASK_CALLS_IN_FLIGHT = 2
    # The model client retries inline, sleeping for real: keep those sleeps short.
    settings.LONGHAUL_RETRY_BASE_SECONDS = 0.02
    settings.LONGHAUL_RETRY_CAP_SECONDS = 60.0
    settings.LONGHAUL_MODEL_PROVIDER = "offline"
    settings.LONGHAUL_MODEL_BASE_URL = model_server.base_url
    settings.LONGHAUL_MODEL = "fake-model"
    settings.LONGHAUL_MODEL_API_KEY = "test-key"
    server, state = mcp_server
    settings.LONGHAUL_MCP_SERVERS = str(write_servers_file(tmp_path / "servers.json", server))

    real_execute = operations._execute

    async def counted_execute(op, *, client, budget):
        FAULTS.executions[op.key] += 1
        MEANWHILE.reached("call")
        try:
            return await real_execute(op, client=client, budget=budget)
        except RateLimited as refused:
            if refused.retry_after is not None:
                # The provider refused it (429): it did not run, and runs when its pool's pause ends.
                FAULTS.executions[op.key] -= 1
            raise

    monkeypatch.setattr(operations, "_execute", counted_execute)
    real_respond = chat.agent.respond

    def respond_or_fail(run):
        MEANWHILE.reached("chat turn")
        if FAULTS.chat_failures_left > 0:
            FAULTS.chat_failures_left -= 1
            raise RuntimeError("the chat agent crashed, as the test asked")
        return real_respond(run)

    monkeypatch.setattr(chat.agent, "respond", respond_or_fail)
    real_run, real_commit = runner.run, runner._commit

    def run_after_claim(task, *, owner):
        MEANWHILE.reached("claimed")
        return real_run(task, owner=owner)

    def commit_after_step(*args, **kwargs):
        MEANWHILE.reached("step")
        return real_commit(*args, **kwargs)

    monkeypatch.setattr(runner, "run", run_after_claim)
    monkeypatch.setattr(runner, "_commit", commit_after_step)
    settings.LONGHAUL_NOTIFIER = f"{__name__}.notifier"
    # Every gateway batch and MCP call builds an httpx2 client, and loading the CA bundle each time was
    # most of their cost here: one context per configuration serves them all.
    monkeypatch.setattr(httpx2_transports, "create_ssl_context",
                        shared_ssl_context(httpx2_transports.create_ssl_context))
    for name in ("tasks", "chat"):  # the faults this test injects are logged by the hundred
        monkeypatch.setattr(logging.getLogger(name), "level", logging.CRITICAL)
    # ... but an admission that gives up taking slots back is a failure of its own (check_all).
    admission = logging.getLogger(scheduling.__name__)
    monkeypatch.setattr(admission, "level", logging.ERROR)
    admission.addHandler(ADMISSIONS_GIVEN_UP)
    FAULTS.reset()
    MEANWHILE.reset()
    yield {"acme": acme, "globex": globex, "alice": alice, "bob": bob, "charlie": charlie,
           "remote_calls": RemoteCalls(state), "settings": settings, "model_server": model_server}
    admission.removeHandler(ADMISSIONS_GIVEN_UP)
    FAULTS.reset()
    MEANWHILE.reset()


def notifier(delivery: notifications.Delivery) -> Any:
    """chat's notifier, with a point between starting the notification run and recording it."""
    from chat.notify import deliver

    run_id = deliver(delivery)
    MEANWHILE.reached("delivery")
    return run_id


def shared_ssl_context(create: Any) -> Any:
    contexts: dict[tuple, Any] = {}

    def shared(verify=True, cert=None, trust_env=True):
        if not isinstance(verify, bool) or cert is not None:
            return create(verify=verify, cert=cert, trust_env=trust_env)
        if (verify, trust_env) not in contexts:
            contexts[verify, trust_env] = create(verify=verify, cert=cert, trust_env=trust_env)
        return contexts[verify, trust_env]

    return shared


# --- the broker, in-process ------------------------------------------------------------------------


def due_messages(now: datetime) -> list[OrmQ]:
    return list(OrmQ.objects.filter(lock__lte=now).order_by("lock", "id"))


def only_watches_left() -> bool:
    """No call is left but those watching a remote task while its owner is asked: they come back every
    minute for as long as nobody answers, which in a drain is for ever (answering is a person's part)."""
    return not (Operation.objects.filter(status__in=UNFINISHED_OPS, args__isnull=False)
                .exclude(key__contains=f":{operations.WATCH_PREFIX}", task__status=S.WAITING_INPUT).exists())


def is_work(row: OrmQ, *, watches_only: bool) -> bool:
    """A kick that can move something: any but a gateway kick when only watch calls are left."""
    return not (watches_only and SignedPackage.loads(row.payload)["func"].endswith(".run_operations"))


def run_message(row: OrmQ) -> None:
    """What a django-q2 worker does with a message: call its function."""
    package = SignedPackage.loads(row.payload)
    import_string(package["func"])(*package["args"], **package.get("kwargs", {}))
    gateway_thread.join()  # a gateway job runs on a thread of its own: its rule ends with it


def take_and_run(row: OrmQ) -> None:
    """One worker takes the message (another may have taken it meanwhile) and runs it."""
    taken, _ = OrmQ.objects.filter(pk=row.pk).delete()
    if taken:
        run_message(row)


def sweep(now: datetime) -> None:
    """Both schedules: the task sweeper and the chat sweeper."""
    sweeper.run_once(now=now)
    chat_jobs.sweep()


# --- the checks ---------------------------------------------------------------------------------------


TASK_FIELDS = ("pk", "tenant_id", "tenant__max_running", "kind", "status", "waiting_reason", "current_step",
               "lease_owner", "lease_expires_at", "next_run_at", "notification_status", "next_notification_at",
               "notification_lease_expires_at", "dispatch_version", "dispatch_attempt")


class Rows:
    """What the liveness checks read, once per check: every task, the unfinished calls, the chat runs and
    the sweeper's repair alerts (an example has a handful of each)."""

    def __init__(self) -> None:
        self.tasks = list(Task.objects.values(*TASK_FIELDS))
        self.calls = list(Operation.objects.filter(args__isnull=False, status__in=UNFINISHED_OPS).values(
            "key", "task_id", "step", "kind", "name", "status", "started_at", "task__status"))
        self.runs = list(Run.objects.values("pk", "kind", "status", "idempotency_key", "lease_expires_at",
                                            "tenant_id"))
        self.repairs = list(Alert.objects.filter(kind="liveness").values_list("message", flat=True))


def stranded_tasks(rows: Rows, now: datetime, *, kept: dict[int, int], kept_system: int = 0) -> list[str]:
    """DESIGN §4, read independently of tasks/liveness.py: a task that is not terminal has an unexpired
    lease, a due time, an unfinished call whose completion makes it due, or waits for a person; a
    queued task waits only while its tenant or the system is at its running cap, and no cap is exceeded.
    `kept`: the slots a tenant held when an operator lowered its cap under them, which it keeps until its
    tasks give them up (admission never takes a running task's slot for a cap); `kept_system`: the same for
    the system cap (LONGHAUL_MAX_RUNNING), lowered under the slots all tenants held."""
    waited_for = {(c["task_id"], c["step"]) for c in rows.calls}
    holding = slots_held(rows)
    all_holding = sum(holding.values())
    caps = {t["tenant_id"]: t["tenant__max_running"] for t in rows.tasks}
    problems = [f"tenant {tenant} holds {n} running slots (cap {caps[tenant]}, {kept.get(tenant, 0)} kept)"
                for tenant, n in holding.items() if n > max(caps[tenant], kept.get(tenant, 0))]
    if all_holding > max(django_settings.LONGHAUL_MAX_RUNNING, kept_system):
        problems.append(f"all tenants hold {all_holding} running slots (cap {django_settings.LONGHAUL_MAX_RUNNING}, "
                        f"{kept_system} kept)")
    for t in rows.tasks:
        if t["status"] in TERMINAL | PERSON:
            continue
        if t["status"] == S.QUEUED:
            if all_holding < django_settings.LONGHAUL_MAX_RUNNING and holding[t["tenant_id"]] < t["tenant__max_running"]:
                problems.append(f"task {t['pk']} queued while a slot is free (its tenant holds {holding[t['tenant_id']]} "
                                f"of {t['tenant__max_running']}, all tenants {all_holding} of "
                                f"{django_settings.LONGHAUL_MAX_RUNNING})")
            continue
        leased = bool(t["lease_owner"]) and t["lease_expires_at"] is not None and t["lease_expires_at"] > now
        due = t["status"] in CLAIMABLE and t["next_run_at"] is not None
        waits_for_calls = (t["waiting_reason"] in ("model", "tool") and not t["lease_owner"] and t["next_run_at"] is None
                           and (t["pk"], t["current_step"] - 1) in waited_for)
        if not (leased or due or waits_for_calls):
            problems.append(f"task {t['pk']} {t['status']} ({t['waiting_reason'] or '-'}) at step {t['current_step']}: "
                            f"no lease, no due time, no call to wait for")
    return problems


def tasks_without_a_kick(rows: Rows, now: datetime) -> list[str]:
    """A task released with its next step due (nobody holds it) has a step kick on its way, due by then: its
    own, or one that goes on to the task due longest (kicks.kick_steps), whose worker ends its turn kicking the
    next. Waiting for the sweeper's safety net would be a stall of a minute, not progress. (A task whose holder
    died is the sweeper's, or a kick's lease watch's: it is held, so not looked at here.)"""
    kicks_at = sorted(OrmQ.objects.filter(key=kicks.queue_of("advance")).values_list("lock", flat=True))
    return [f"task {t['pk']} {t['status']} is due at {t['next_run_at']:%H:%M:%S.%f} with no step kick on its way "
            f"(kicks at {[f'{at:%H:%M:%S.%f}' for at in kicks_at]})"
            for t in rows.tasks if t["status"] in CLAIMABLE and not t["lease_owner"] and t["next_run_at"] is not None
            and not (kicks_at and kicks_at[0] <= max(t["next_run_at"], now))]


def slots_held(rows: Rows) -> Counter[int]:
    return Counter(t["tenant_id"] for t in rows.tasks if t["status"] in HOLDS_SLOT)


def stranded_calls(rows: Rows) -> list[str]:
    """A task that ends closes its calls not yet taken, except the one telling a remote server to stop,
    which runs after the end (DESIGN §10). (A call a gateway job took and died holding is closed by the
    sweeper once its lease has expired, as a dead worker's task is recovered.)"""
    return [f"operation {c['key']} ({c['name']}) still pending though its task is {c['task__status']}: nothing "
            f"will run or close it" for c in rows.calls
            if c["status"] == OperationStatus.PENDING and c["task__status"] in TERMINAL
            and (c["kind"], c["name"]) != STOPS_REMOTE_WORK]


def sweeper_repairs(rows: Rows) -> list[str]:
    """The sweeper repaired nothing: each repair (tasks/liveness.py raises an alert for it) is a row that
    had no way forward at some commit, which DESIGN §4 rules out. Closing a call whose gateway job died
    holding it, after its task ended, is recovery from that death, not a repair of a broken rule."""
    problems = []
    for message in rows.repairs:
        orphan = ORPHAN_CLOSED.search(message)
        if not (orphan and Operation.objects.filter(key=orphan["key"], started_at__isnull=False).exists()):
            problems.append(f"the sweeper had to repair a row: {message}")
    return problems


def stranded_outbox(rows: Rows, now: datetime) -> list[str]:
    """Pending and retry rows have a due time, a claimed row a lease, and a dispatched row a run still
    going or a time at which someone looks at what became of it; a running chat run has a lease."""
    problems = []
    run_status = {r["idempotency_key"]: r["status"] for r in rows.runs if r["kind"] == Run.Kind.NOTIFICATION}
    for t in rows.tasks:
        status = t["notification_status"]
        if status in (N.PENDING, N.RETRY) and t["next_notification_at"] is None:
            problems.append(f"notification of task {t['pk']} {status} with no due time")
        elif status == N.CLAIMED and t["notification_lease_expires_at"] is None:
            problems.append(f"notification of task {t['pk']} claimed with no lease expiry")
        elif status == N.DISPATCHED:
            key = f"task:{t['pk']}:{t['dispatch_version']}:{t['dispatch_attempt']}"
            if run_status.get(key) not in ACTIVE_RUN and t["next_notification_at"] is None:
                problems.append(f"notification of task {t['pk']} dispatched, its run {key} is "
                                f"{run_status.get(key, 'missing')}, and nobody looks again")
    problems += [f"chat run {r['pk']} running with no lease expiry" for r in rows.runs
                 if r["status"] == Run.Status.RUNNING and r["lease_expires_at"] is None]
    answering = Counter(r["tenant_id"] for r in rows.runs
                        if r["status"] == Run.Status.RUNNING and r["lease_expires_at"] and r["lease_expires_at"] > now)
    cap = django_settings.LONGHAUL_CHAT_RUNS_PER_TENANT
    problems += [f"tenant {tenant} answers {n} chat runs at once (cap {cap})" for tenant, n in answering.items()
                 if n > cap]
    return problems


# One round trip for the record-keeping rules; each row is (rule, detail).
CONSISTENCY_SQL = """
SELECT 'event seqs have a gap', 'task ' || t.id || ': last_event_seq ' || t.last_event_seq || ', events '
       || COALESCE(e.n, 0) || ' from ' || COALESCE(e.lo, 0) || ' to ' || COALESCE(e.hi, 0)
  FROM tasks_task t
  LEFT JOIN (SELECT task_id, COUNT(*) n, MIN(seq) lo, MAX(seq) hi FROM tasks_taskevent GROUP BY task_id) e
    ON e.task_id = t.id
 WHERE COALESCE(e.n, 0) <> t.last_event_seq OR (t.last_event_seq > 0 AND (e.lo <> 1 OR e.hi <> t.last_event_seq))
UNION ALL
SELECT 'a checkpoint is not a counted step', 'task ' || t.id || ': checkpoint of step ' || c.step
       || ', current_step ' || t.current_step
  FROM tasks_task t JOIN tasks_checkpoint c ON c.task_id = t.id
 WHERE c.step > t.current_step
UNION ALL
SELECT 'a checkpoint was written by an older claim than the step before it',
       'task ' || w.task_id || ': step ' || w.step || ' token ' || w.fencing_token || ' after token ' || w.before
  FROM (SELECT task_id, step, fencing_token,
               LAG(fencing_token) OVER (PARTITION BY task_id ORDER BY step) AS before
          FROM tasks_checkpoint) w
 WHERE w.fencing_token < w.before
UNION ALL
SELECT 'a checkpoint carries a newer token than its task',
       'task ' || t.id || ': checkpoint token ' || c.fencing_token || ', task token ' || t.fencing_token
  FROM tasks_task t JOIN tasks_checkpoint c ON c.task_id = t.id
 WHERE c.fencing_token > t.fencing_token
UNION ALL
SELECT 'a side effect ran twice', 'task ' || task_id || ' step ' || step || ': ' || COUNT(*) || ' effects'
  FROM tasks_sleepeffect GROUP BY task_id, step HAVING COUNT(*) > 1
UNION ALL
SELECT 'a notification version was told twice',
       'task ' || r.task_id || ' v' || r.task_version || ': ' || COUNT(*) || ' assistant messages'
  FROM chat_message m JOIN chat_run r ON r.id = m.run_id
 WHERE m.role = 'assistant' AND r.kind = 'notification'
 GROUP BY r.task_id, r.task_version HAVING COUNT(*) > 1
UNION ALL
SELECT 'a notification run key is not task:{id}:{version}:{attempt}',
       'run ' || r.id || ' key ' || COALESCE(r.idempotency_key, 'none') || ' for task ' || COALESCE(r.task_id, 0)
       || ' v' || r.task_version
  FROM chat_run r
 WHERE r.kind = 'notification'
   AND COALESCE(r.idempotency_key, '') !~ ('^task:' || r.task_id || ':' || r.task_version || ':[0-9]+$')
UNION ALL
SELECT 'a dead letter raised no alert', 'task ' || t.id
  FROM tasks_task t
 WHERE t.notification_status = 'dead_letter'
   AND NOT EXISTS (SELECT 1 FROM tasks_alert a WHERE a.task_id = t.id AND a.kind = 'dead_letter')
UNION ALL
SELECT 'a notification was dead-lettered before its version failed enough times',
       'task ' || t.id || ' v' || t.dispatch_version || ': ' || (
           SELECT COUNT(*) FROM chat_run r WHERE r.task_id = t.id AND r.kind = 'notification'
              AND r.task_version = t.dispatch_version AND r.status IN ('failed', 'interrupted'))
       || ' failed runs of that version; ' || LEFT(t.notification_error, 80)
  FROM tasks_task t
 WHERE t.notification_status = 'dead_letter'
   AND t.notification_error NOT LIKE %(gone)s AND t.notification_error NOT LIKE %(busy)s
   AND (SELECT COUNT(*) FROM chat_run r WHERE r.task_id = t.id AND r.kind = 'notification'
           AND r.task_version = t.dispatch_version AND r.status IN ('failed', 'interrupted')) < %(max_failures)s
UNION ALL
SELECT 'an attempt counter ran past its bound', 'task ' || id || ': ' || attempts || ' claims of one step'
  FROM tasks_task WHERE attempts > %(max_attempts)s + 1
UNION ALL
SELECT 'an attempt counter ran past its bound', 'task ' || id || ': ' || notification_attempt_count
       || ' failed deliveries'
  FROM tasks_task WHERE notification_attempt_count > %(max_failures)s
UNION ALL
SELECT 'an attempt counter ran past its bound', 'chat run ' || id || ': ' || attempts || ' attempts'
  FROM chat_run WHERE attempts > %(max_attempts)s
UNION ALL
SELECT 'message seqs are not 1..message_seq', 'thread ' || t.id || ': ' || COUNT(m.id) || ' messages, highest '
       || COALESCE(MAX(m.seq), 0) || ', message_seq ' || t.message_seq
  FROM chat_thread t LEFT JOIN chat_message m ON m.thread_id = t.id
 GROUP BY t.id, t.message_seq HAVING COUNT(m.id) <> t.message_seq OR COALESCE(MAX(m.seq), 0) <> t.message_seq
UNION ALL
SELECT 'thread stream items are numbered past item_seq', 'thread ' || t.id || ': highest '
       || MAX(i.seq) || ', item_seq ' || t.item_seq
  FROM chat_thread t JOIN chat_threaditem i ON i.thread_id = t.id
 GROUP BY t.id, t.item_seq HAVING MAX(i.seq) > t.item_seq
-- Not 1..item_seq without gaps: a deleted task's items go with it, and a reader continuing after N skips
-- the numbers they had. The rule below checks that no status change of a task still there is missing.
UNION ALL
SELECT 'a thread stream item came before an earlier event of its task',
       'thread ' || w.thread_id || ' item ' || w.seq || ': task ' || w.task_id || ' event ' || w.task_seq
  FROM (SELECT thread_id, seq, task_id, task_seq,
               LAG(task_seq) OVER (PARTITION BY thread_id, task_id ORDER BY seq) AS before
          FROM chat_threaditem) w
 WHERE w.task_seq <= w.before
UNION ALL
SELECT 'a status change of a task in a thread is missing from its stream',
       'task ' || e.task_id || ' event ' || e.seq || ' (' || e.kind || ')'
  FROM tasks_taskevent e JOIN tasks_task t ON t.id = e.task_id
 WHERE t.thread_id IS NOT NULL AND e.kind = ANY(%(status_kinds)s)
   AND NOT EXISTS (SELECT 1 FROM chat_threaditem i WHERE i.event_id = e.id)
"""


def record_problems(remote_calls: RemoteCalls) -> list[str]:
    for thread_pk in Thread.objects.values_list("pk", flat=True):
        number_new_items(thread_pk)  # what a reader of the thread stream does first
    with connection.cursor() as cursor:
        cursor.execute(CONSISTENCY_SQL, {
            "gone": NOT_RUN_FAILURES[0] + "%", "busy": NOT_RUN_FAILURES[1] + "%",
            "max_failures": notifications.MAX_FAILURES, "max_attempts": django_settings.LONGHAUL_MAX_ATTEMPTS,
            "status_kinds": sorted(STATUS_CHANGE_KINDS)})
        problems = [f"{rule}: {detail}" for rule, detail in cursor.fetchall()]
    problems += [f"operation {key} was executed {n} times" for key, n in FAULTS.executions.items() if n > 1]
    return problems + remote_calls.duplicates()


def unsettled() -> list[str]:
    """What the drain must not leave: work that is neither finished nor waiting for a person."""
    problems = [f"task {pk} still {status} ({reason or '-'})" for pk, status, reason in
                Task.objects.exclude(status__in=TERMINAL | PERSON).values_list("pk", "status", "waiting_reason")]
    problems += [f"notification of task {pk} still {status}" for pk, status in
                 Task.objects.exclude(notification_status__in=SETTLED_NOTIFICATIONS).values_list(
                     "pk", "notification_status")]
    problems += [f"chat run {pk} still {status} after {attempts} attempts" for pk, status, attempts in
                 Run.objects.filter(status__in=ACTIVE_RUN).values_list("pk", "status", "attempts")]
    problems += [f"task {pk} was deleted by its owner but is still here, {status}" for pk, status in
                 Task.objects.filter(delete_requested_at__isnull=False).values_list("pk", "status")]
    problems += [f"operation {key} still {status} though its task is {task_status}" for key, status, task_status in
                 Operation.objects.filter(status__in=UNFINISHED_OPS, task__status__in=TERMINAL).values_list(
                     "key", "status", "task__status")]
    return problems


def snapshot_of(task_id: int) -> dict[str, Any]:
    """Everything a worker's step may write about a task (kicks aside: they are only hints)."""
    return {
        "task": Task.objects.filter(pk=task_id).values().first(),
        "events": list(TaskEvent.objects.filter(task_id=task_id).values_list("seq", "kind")),
        "checkpoints": list(Checkpoint.objects.filter(task_id=task_id).values_list("step", "fencing_token")),
        "operations": list(Operation.objects.filter(task_id=task_id).order_by("key").values_list(
            "key", "status", "attempts", "fencing_token", "result")),
        "effects": SleepEffect.objects.filter(task_id=task_id).count(),
        "alerts": list(Alert.objects.filter(task_id=task_id).values_list("kind", "message")),
    }


def changes(before: dict, after: dict) -> dict:
    return {k: (before[k], after[k]) for k in before if before[k] != after[k]}


# --- the machine ------------------------------------------------------------------------------------


class LivenessMachine(RuleBasedStateMachine):
    world: dict[str, Any] = {}

    def __init__(self) -> None:
        super().__init__()
        reset_tables()
        FAULTS.reset()
        self.use_model("offline")
        self.traveller = time_machine.travel(START, tick=False)
        self.clock = self.traveller.start()
        self.task_ids: list[int] = []
        self.thread_ids: list[int] = []
        self.zombies: list[tuple[Task, str]] = []
        self.terminal: dict[int, str] = {}
        self.deaths = 0
        self.swept = False
        # When a kick was lost: its tasks wait for the sweeper, which kicks those due for KICK_GRACE.
        self.kick_lost_at: datetime | None = None
        self.seen: set[str] = set()
        self.remote_tasks = 0
        self.turn_elsewhere: psycopg.Connection | None = None  # the session of other processes' gateway jobs
        self.turns_elsewhere: list[int] = []  # the turns it holds
        self.kept: dict[int, int] = {}  # tenant -> slots held when its cap was lowered under them (stranded_tasks)
        self.kept_system = 0  # slots all tenants held when the system cap was lowered under them
        ADMISSIONS_GIVEN_UP.messages.clear()
        self.world["settings"].LONGHAUL_MAX_RUNNING = SYSTEM_CAP  # a rule changes it

    # --- helpers

    def use_model(self, how: str) -> None:
        if how == "offline":
            self.world["settings"].LONGHAUL_MODEL_PROVIDER = "offline"
        else:
            self.world["settings"].LONGHAUL_MODEL_PROVIDER = "openai"
            self.world["model_server"].default = MODEL_ANSWERS[how]

    @staticmethod
    def now() -> datetime:
        return clock.now()

    def pick_task(self, i: int, *statuses: str) -> Task | None:
        """The i-th (modulo) of this example's tasks that are in one of `statuses` (any, if none given)."""
        rows = Task.objects.filter(pk__in=self.task_ids).select_related("owner").order_by("pk")
        if statuses:
            rows = rows.filter(status__in=statuses)
        found = list(rows)
        return found[i % len(found)] if found else None

    def owner(self, who: int) -> tuple[Any, Any]:
        w = self.world
        return [(w["acme"], w["alice"]), (w["acme"], w["bob"]), (w["globex"], w["charlie"])][who]

    def thread_for(self, tenant, user, choice: int) -> int | None:
        """0: no thread; 1: a new thread; 2 and up: one of this user's threads, else a new one."""
        if choice == 0:
            return None
        mine = list(Thread.objects.filter(owner=user, tenant=tenant).order_by("pk").values_list("pk", flat=True))
        if choice >= 2 and mine:
            return mine[choice % len(mine)]
        thread = Thread.objects.create(tenant=tenant, owner=user, title=f"thread {len(self.thread_ids) + 1}")
        self.thread_ids.append(thread.pk)
        return thread.pk

    def submit(self, who: int, thread_choice: int, kind: str, task_input: dict, budget: dict | None) -> None:
        tenant, user = self.owner(who)
        thread_id = self.thread_for(tenant, user, thread_choice)
        task, _ = actions.submit(tenant=tenant, user=user, submission=actions.Submission(
            kind=kind, input=task_input, budget=budget, thread_id=thread_id, name=f"{kind} {len(self.task_ids) + 1}"))
        self.task_ids.append(task.pk)
        event(f"submitted {kind}")

    # --- submissions

    @precondition(lambda self: len(self.task_ids) < MAX_TASKS)
    @rule(
        who=st.integers(0, 2), thread=st.integers(0, 3), steps=st.integers(1, 4), side_effect=st.booleans(),
        fail=st.sampled_from([None, ("transient", 1), ("transient", 3), ("permanent", 1)]),
        fail_at=st.integers(1, 4), ask_at=st.sampled_from([None, 1, 2]),
        budget=st.sampled_from([None, {"max_steps": 1}, {"max_steps": 2}, {"max_retries": 0}]),
    )
    def submit_sleep(self, who, thread, steps, side_effect, fail, fail_at, ask_at, budget):
        spec: dict[str, Any] = {"steps": steps, "side_effect": side_effect}
        if fail is not None:
            spec.update(fail_at_step=min(fail_at, steps), fail_kind=fail[0], fail_times=fail[1])
        if ask_at is not None and ask_at <= steps:
            spec.update(ask_at_step=ask_at, question="Go on?")
        self.submit(who, thread, "sleep", spec, budget)

    @precondition(lambda self: len(self.task_ids) < MAX_TASKS)
    @rule(who=st.integers(0, 2), thread=st.integers(0, 3),
          budget=st.sampled_from([None, {"max_model_calls": 4}, {"max_model_calls": 1}, {"max_tool_calls": 6},
                                  {"max_steps": 5}, {"max_steps": 2}]))
    def submit_research(self, who, thread, budget):
        self.submit(who, thread, "research", {"question": "How does asyncio task cancellation work?"}, budget)

    @precondition(lambda self: len(self.task_ids) < MAX_TASKS and self.remote_tasks < MAX_REMOTE_TASKS)
    @rule(who=st.integers(0, 2), thread=st.integers(0, 3),
          tool=st.sampled_from([("slow_report", 0), ("failing_job", 0), ("approval_job", 0), ("quick_echo", 0),
                                ("tool_error_job", 0), ("stubborn_job", 0.3)]))
    def submit_mcp(self, who, thread, tool):
        """A remote tool; these run on the server's wall clock, so they are kept short."""
        name, seconds = tool
        tag = uuid.uuid4().hex
        arguments = {"text": tag} if name == "quick_echo" else {"seconds": seconds, "poll_ms": 100, "tag": tag}
        self.submit(who, thread, "mcp", {"server": SERVER_NAME, "tool": name, "arguments": arguments}, None)
        self.remote_tasks += 1

    # --- what users do

    @precondition(lambda self: self.task_ids)
    @rule(i=st.integers(0, MAX_TASKS - 1), keep_results=st.booleans())
    def cancel(self, i, keep_results):
        task = self.pick_task(i, *ACTIVE)
        if task is None:
            return
        actions.request_cancel(task, user=task.owner, reason="changed my mind", keep_results=keep_results)
        self.seen.add(f"cancel asked of {task.kind} {task.status}" + (" keeping results" if keep_results else ""))

    @precondition(lambda self: self.task_ids)
    @rule(i=st.integers(0, MAX_TASKS - 1))
    def pause(self, i):
        task = self.pick_task(i, *PAUSABLE)
        if task is None:
            return
        try:
            actions.request_pause(task, user=task.owner, reason="later")
        except Conflict:
            return  # asked twice
        self.seen.add(f"pause asked of {task.kind} {task.status}")

    @precondition(lambda self: self.task_ids)
    @rule(i=st.integers(0, MAX_TASKS - 1),
          budget=st.sampled_from([None, {"max_model_calls": 200}, {"max_steps": 1000}, {"max_tool_calls": 500},
                                  {"max_retries": 5}]))
    def resume(self, i, budget):
        task = self.pick_task(i, S.PAUSED, S.PARTIAL)
        if task is None:
            return
        actions.resume(task, user=task.owner, budget=budget)
        self.seen.add(f"resumed {task.kind} from {task.status}" + (" with more budget" if budget else ""))

    @precondition(lambda self: self.task_ids)
    @rule(i=st.integers(0, MAX_TASKS - 1))
    def answer(self, i):
        task = self.pick_task(i, S.WAITING_INPUT)
        if task is None:
            return
        actions.answer(task, user=task.owner, text="markdown")
        self.seen.add(f"answered {task.kind}")

    # --- what operators do

    @rule(tenant=st.sampled_from(["acme", "globex"]), max_running=st.integers(1, 4), weight=st.integers(0, 3))
    def operator_sets_quotas(self, tenant, max_running, weight):
        """An operator sets a tenant's running cap and weight (the admin's path): admission runs at once, and may
        take slots back from the other tenant or leave this one holding more than its new cap until its tasks
        give them up. Never 0 running: a tenant an operator stops altogether has no way forward until it is
        raised again, by design."""
        tenant_row = self.world[tenant]
        max_running = min(max_running, django_settings.LONGHAUL_MAX_RUNNING)  # set_quotas refuses more
        before = Tenant.objects.values_list("max_running", "weight").get(pk=tenant_row.pk)
        holding = Task.objects.filter(tenant=tenant_row, status__in=HOLDS_SLOT)
        before_admission = holding.count()
        actions.set_quotas(tenant_row, user=self.world["alice"], quotas={"max_running": max_running, "weight": weight})
        # Kept: what it held, less what the admission just took back; never what it was just given.
        kept = min(before_admission, holding.count())
        if kept > max_running:
            self.kept[tenant_row.pk] = kept
        else:
            self.kept.pop(tenant_row.pk, None)
        if (max_running, weight) != before:
            self.seen.add(f"quotas {'lowered' if (max_running, weight) < before else 'raised'}")

    @rule(cap=st.integers(1, SYSTEM_CAP + 1))
    def operator_sets_the_system_cap(self, cap):
        """An operator sets LONGHAUL_MAX_RUNNING and restarts the processes: the workers admit as they start
        (scheduling.admit_at_start), into the slots a raised cap made free. Lowered under the slots the tasks hold,
        nobody is admitted past it, and the tasks keep their slots until they give them up, or are asked to for a
        tenant owed one."""
        before = django_settings.LONGHAUL_MAX_RUNNING
        holding = Task.objects.filter(status__in=HOLDS_SLOT)
        before_admission = holding.count()
        self.world["settings"].LONGHAUL_MAX_RUNNING = cap
        scheduling.admit_at_start()
        # Kept: what was held, less what the admission took back; never what it gave.
        kept = min(before_admission, holding.count())
        self.kept_system = kept if kept > cap else 0
        if cap != before:
            self.seen.add(f"system cap {'lowered' if cap < before else 'raised'}"
                          + (" under the slots held" if kept > cap else ""))

    # --- the broker

    @rule(i=st.integers(0, 15), fate=st.sampled_from(["delivered", "lost", "duplicated"]))
    def broker(self, i, fate):
        """One due kick is delivered, lost (deleted unrun), or duplicated (run and left for another worker)."""
        due = due_messages(self.now())
        if not due:
            return
        row = due[i % len(due)]
        if fate == "delivered":
            take_and_run(row)
        elif fate == "lost":
            OrmQ.objects.filter(pk=row.pk).delete()
            self.kick_lost_at = self.now()
        else:
            run_message(row)

    @rule()
    def a_worker_goes_on(self):
        """One due step kick, run by a worker whose turn lasts: it goes on from task to task while nothing else
        waits, releasing each task it leaves without a kick (the other rules' workers run one step a job)."""
        due = [row for row in due_messages(self.now())
               if SignedPackage.loads(row.payload)["func"] == kicks.JOBS["advance"]]
        if not due:
            return
        self.world["settings"].LONGHAUL_STEP_SLICE_MS = 60_000
        try:
            take_and_run(due[0])
        finally:
            self.world["settings"].LONGHAUL_STEP_SLICE_MS = 0
        self.seen.add("a worker went on")

    @rule(rounds=st.integers(1, 6))
    def workers_catch_up(self, rounds):
        """Workers take every due kick and a gateway runs the due calls, for a few rounds (the kicks
        those jobs write come due too): the system working normally for a moment."""
        for _ in range(rounds):
            due = due_messages(self.now())
            if due:
                for row in due:
                    take_and_run(row)
            elif operations.due_exists(self.now()):
                operations.run_due(run_for=GATEWAY_RUN_FOR)
            else:
                return

    # --- gateways and workers

    @rule(dies=st.booleans(), limit=st.integers(1, 3))
    def gateway(self, dies, limit):
        """A gateway job runs the due calls, or claims a batch of them and dies (their lease must expire)."""
        if dies:
            self.deaths += 1
            operations.claim_batch(owner=f"dead-gateway:{self.deaths}", limit=limit, now=self.now())
        elif operations.due_exists(self.now()):
            operations.run_due(run_for=GATEWAY_RUN_FOR)

    @rule(holds=st.booleans(), dies=st.booleans(), turns=st.integers(1, 2))
    def gateway_elsewhere(self, holds, dies, turns):
        """Other processes' gateway jobs take turns (`turns` of those there are) and claim nothing while they hold
        them (their calls out fill their caps): while they hold every turn the steps kick no gateway job, and while
        one is free they kick a job that takes it. Or they give their turns back, kicking what is left on their
        way out, or die holding them (their session ends, and the locks with it)."""
        if holds and self.turn_elsewhere is None:
            session = psycopg.connect(requested.conninfo(), autocommit=True)
            taken = [key for key in broker.gateway_turn_keys()[:turns]
                     if session.execute("SELECT pg_try_advisory_lock(%s)", [key]).fetchone()[0]]
            if taken:
                self.turn_elsewhere, self.turns_elsewhere = session, taken
            else:
                session.close()
        elif not holds and self.turn_elsewhere is not None:
            self.give_the_turn_back(dies=dies)

    def give_the_turn_back(self, *, dies: bool) -> None:
        session, self.turn_elsewhere = self.turn_elsewhere, None
        if dies:
            session.close()
            return
        for key in self.turns_elsewhere:
            session.execute("SELECT pg_advisory_unlock(%s)", [key])
        session.close()
        operations.kick_if_claimable()

    @precondition(lambda self: self.task_ids)
    @rule(i=st.integers(0, MAX_TASKS - 1))
    def worker_claims_and_dies(self, i):
        task = self.pick_task(i, *CLAIMABLE)
        if task is None:
            return
        self.deaths += 1
        owner = f"dead-worker:{self.deaths}"
        held = leases.claim(task.pk, owner=owner, now=self.now())
        if held is not None:
            self.zombies.append((held, owner))

    @precondition(lambda self: self.zombies)
    @rule(i=st.integers(0, 5))
    def zombie_wakes_up(self, i):
        """A worker that stopped (a long pause, a frozen VM) goes on with its step. If its lease was
        taken over meanwhile, it writes nothing at all."""
        held, owner = self.zombies.pop(i % len(self.zombies))
        current = Task.objects.filter(pk=held.pk).values_list("fencing_token", flat=True).first()
        fenced_out = current != held.fencing_token
        if not fenced_out:
            event("a worker woke up still holding its lease")
        before = snapshot_of(held.pk)
        runner.run(held, owner=owner)
        if fenced_out:
            event("a fenced-out worker woke up")
            after = snapshot_of(held.pk)
            assert after == before, (f"a worker fenced out (its token {held.fencing_token}, the task's {current}) "
                                     f"wrote: {changes(before, after)}")

    @precondition(lambda self: self.task_ids)
    @rule(i=st.integers(0, MAX_TASKS - 1), started_run=st.booleans())
    def notifier_claims_and_dies(self, i, started_run):
        """A delivery job takes the notification lease and dies, before or after starting its run."""
        self.deaths += 1
        delivery = notifications.claim(self.task_ids[i % len(self.task_ids)], owner=f"dead-notifier:{self.deaths}",
                                       now=self.now())
        if delivery is not None and started_run:
            try:
                import_string(django_settings.LONGHAUL_NOTIFIER)(delivery)
            except (notifications.ThreadBusy, notifications.ThreadGone):
                pass

    @rule(i=st.integers(0, 5))
    def chat_worker_claims_and_dies(self, i):
        active = list(Run.objects.filter(status__in=ACTIVE_RUN).order_by("pk").values_list("pk", flat=True))
        if active:
            self.deaths += 1
            runs.claim(active[i % len(active)], owner=f"dead-chat:{self.deaths}", now=self.now())

    # --- concurrency

    @rule(point=st.sampled_from(Meanwhile.POINTS),
          action=st.sampled_from(["cancel", "cancel keeping results", "pause", "resume", "answer", "gateway runs",
                                  "workers catch up", "sweeper runs", "lease expires and is taken over",
                                  "thread deleted", "user chats"]),
          i=st.integers(0, MAX_TASKS - 1))
    def meanwhile(self, point, action, i):
        """The next time the runtime reaches `point`, `action` happens at that moment on another connection."""
        MEANWHILE.arm(point, lambda: self.concurrently(action, i))

    def concurrently(self, action: str, i: int) -> None:
        self.seen.add(f"meanwhile: {action}")
        match action:
            case "cancel" | "cancel keeping results":
                self.cancel(i, keep_results=action != "cancel")
            case "pause":
                self.pause(i)
            case "resume":
                self.resume(i, budget=None)
            case "answer":
                self.answer(i)
            case "gateway runs":
                self.gateway(dies=False, limit=1)
            case "workers catch up":
                self.workers_catch_up(rounds=1)
            case "sweeper runs":
                self.sweeper_runs()
            case "lease expires and is taken over":
                self.clock.shift(timedelta(seconds=django_settings.LONGHAUL_LEASE_SECONDS + 1))
                self.sweeper_runs()
                self.workers_catch_up(rounds=1)
            case "thread deleted":
                if self.thread_ids:
                    self.user_deletes_thread(i)
            case "user chats":
                if self.thread_ids:
                    self.user_chats(i)

    # --- time and the sweeper

    @rule(seconds=st.sampled_from(["until the next kick", 0.2, 1, 3, 6, 31, 65, 181, 600, 3600]))
    def time_passes(self, seconds):
        """Past retry and notification backoffs, remote polls, lease expiries (30 s tasks, 120 s chat runs,
        180 s calls), the sweeper's grace periods, and the dispatch watch (10 min)."""
        if seconds == "until the next kick":
            nxt = OrmQ.objects.filter(lock__gt=self.now()).order_by("lock").values_list("lock", flat=True).first()
            if nxt is not None:
                self.clock.move_to(nxt)
        else:
            self.clock.shift(timedelta(seconds=seconds))

    @rule()
    def sweeper_runs(self):
        sweep(self.now())
        self.swept = True
        if self.kick_lost_at is not None and self.now() - self.kick_lost_at >= sweeper.KICK_GRACE:
            self.kick_lost_at = None  # it kicked every task due since before the loss

    # --- chat

    @precondition(lambda self: self.thread_ids)
    @rule(i=st.integers(0, 5))
    def user_deletes_thread(self, i):
        """Its tasks go with it: the ended ones at once, the others once their cancel has ended them."""
        thread = Thread.objects.select_related("owner").get(pk=self.thread_ids.pop(i % len(self.thread_ids)))
        chat_deletion.delete_thread(thread, user=thread.owner)
        event("deleted a thread")

    @precondition(lambda self: self.task_ids)
    @rule(i=st.integers(0, MAX_TASKS - 1))
    def user_deletes_task(self, i):
        task = self.pick_task(i)
        if task is None:
            return
        try:
            deletion.delete_task(task, user=task.owner)
            event("deleted a task")
        except Conflict:
            assert task.status not in deletion.DELETABLE or Task.objects.get(pk=task.pk).status not in \
                deletion.DELETABLE

    @precondition(lambda self: self.thread_ids)
    @rule(i=st.integers(0, 5))
    def user_chats(self, i):
        """The thread is busy with a chat turn until a worker answers it."""
        thread = Thread.objects.get(pk=self.thread_ids[i % len(self.thread_ids)])
        try:
            runs.start_run(thread, kind=Run.Kind.CHAT, user_text="what is running?", hidden=False, key=None)
        except Conflict:
            pass

    @rule(how=st.sampled_from(["offline", *MODEL_ANSWERS]))
    def model_server_changes(self, how):
        """Model calls (research, and chat turns) go to the offline provider, or to an OpenAI-compatible
        server that answers, fails with 500s, or answers with malformed output."""
        self.use_model(how)
        self.seen.add(f"model: {how}")

    @rule(n=st.integers(1, 6))
    def chat_agent_breaks(self, n):
        """The next n chat runs (notification runs too) fail."""
        FAULTS.chat_failures_left = n

    # --- invariants

    @invariant()
    def after_each_rule(self):
        MEANWHILE.settle()  # what ran concurrently has finished
        self.check_all()

    def nothing_is_stranded(self, rows: Rows) -> None:
        now = self.now()
        problems = (stranded_tasks(rows, now, kept=self.kept, kept_system=self.kept_system) + stranded_calls(rows)
                    + stranded_outbox(rows, now) + sweeper_repairs(rows))
        # A slot kept under a lowered cap is kept no longer once its task gave it up.
        held = slots_held(rows)
        self.kept = {tenant: min(n, held[tenant]) for tenant, n in self.kept.items() if held[tenant]}
        self.kept_system = min(self.kept_system, sum(held.values()))
        if self.kick_lost_at is None:
            problems += tasks_without_a_kick(rows, now)
        assert not problems, problems
        if self.swept:
            self.swept = False
            self.sweeper_left_no_violation(now)

    @staticmethod
    def sweeper_left_no_violation(now: datetime) -> None:
        """Right after a sweep: tasks/liveness.py finds nothing that its repairs left behind."""
        if liveness is not None:
            violations = liveness.find_violations(now)
            assert violations == [], violations

    def records_are_consistent(self):
        problems = record_problems(self.world["remote_calls"])
        assert not problems, problems

    def terminal_tasks_stay_terminal(self, rows: Rows) -> None:
        for t in rows.tasks:
            pk, kind, status, waiting = t["pk"], t["kind"], t["status"], t["waiting_reason"]
            self.seen.add(f"reached {kind} {status}" + (f" ({waiting})" if waiting else ""))
            if pk in self.terminal:
                assert status == self.terminal[pk], f"task {pk} left {self.terminal[pk]} for {status}"
            elif status in TERMINAL:
                self.terminal[pk] = status

    # --- the end of every example

    def teardown(self):
        try:
            MEANWHILE.reset()
            if self.turn_elsewhere is not None:
                self.give_the_turn_back(dies=False)
            if self.task_ids or self.thread_ids:
                self.drain()
                for kind, status, notification, error in Task.objects.values_list(
                        "kind", "status", "notification_status", "error_message"):
                    event(f"{kind} ended {status}" + (f": {error[:60]}" if error else ""))
                    event(f"notification ended {notification}")
                for what in self.seen:
                    event(what)
                for rule_name in Alert.objects.filter(kind="liveness").values_list("message", flat=True):
                    event(f"sweeper repaired: {rule_name.rsplit('(rule ', 1)[-1].rstrip(')')}")
        finally:
            self.traveller.stop()

    def drain(self) -> None:
        """Run the broker, the gateway, the sweeper (once a minute) and the clock, answering and resuming
        nothing, until nothing moves; then nothing may be left unsettled.

        Nothing moves: no kick is left, no call is due, and sweeps found nothing to do for longer than
        any lease, watch or grace period the runtime waits out before it repairs a row."""
        real_deadline = time.monotonic() + DRAIN_REAL_SECONDS
        last_sweep = self.now() - SWEEP_EVERY
        idle_sweeps = 0
        for round_number in range(DRAIN_ROUNDS):
            now = self.now()
            due = due_messages(now)
            # Watching a remote task whose owner is asked is not progress: a drain with one would never
            # be quiet (the watches are run all the same).
            watches_only = only_watches_left()
            if due:
                if any(is_work(row, watches_only=watches_only) for row in due):
                    idle_sweeps = 0
                for row in due:
                    take_and_run(row)
            elif operations.due_exists(now):
                if not watches_only:
                    idle_sweeps = 0
                operations.run_due(run_for=GATEWAY_RUN_FOR)
            elif now - last_sweep >= SWEEP_EVERY:
                sweep(now)
                last_sweep = now
                self.sweeper_left_no_violation(now)
                watches_only = only_watches_left()
                if any(is_work(row, watches_only=watches_only) for row in OrmQ.objects.all()) or (
                        operations.due_exists(now) and not watches_only):
                    idle_sweeps = 0
                else:
                    idle_sweeps += 1
                    if idle_sweeps > QUIET_SWEEPS or not unsettled():
                        break
            else:
                if time.monotonic() < real_deadline and Task.objects.filter(kind="mcp").exclude(
                        status__in=TERMINAL | PERSON).exists():
                    time.sleep(0.02)  # the fake MCP server's tasks run on the wall clock
                nxt = OrmQ.objects.order_by("lock").values_list("lock", flat=True).first()
                target = last_sweep + SWEEP_EVERY
                self.clock.move_to(max(now, min(target, nxt) if nxt is not None else target))
            if round_number % 10 == 9:
                self.check_all()
        problems = unsettled()
        assert not problems, f"left stranded after the drain: {problems}"
        self.check_all()

    def check_all(self) -> None:
        rows = Rows()
        self.nothing_is_stranded(rows)
        assert not ADMISSIONS_GIVEN_UP.messages, ADMISSIONS_GIVEN_UP.messages
        self.records_are_consistent()
        self.terminal_tasks_stay_terminal(rows)


def test_nothing_is_ever_stranded(world):
    explore(world, examples=EXAMPLES)


def test_nothing_is_ever_stranded_with_two_gateway_turns(world, settings, monkeypatch):
    """The same machine where gateway jobs may claim at once (LONGHAUL_GATEWAY_TURNS): another process's jobs hold
    one turn or both, the steps write gateway kicks while one is free, a job keeps its turn for its slice. Its
    checks are the same: no task or thread is ever stranded, the records stay consistent. (They look at tasks,
    not at gateway kicks: a call whose kick went missing is still claimed by the machine's next gateway rule.)"""
    settings.LONGHAUL_GATEWAY_TURNS = 2
    # A job holding one of several turns keeps it for its whole slice, even with nothing to do: short slices, so
    # that each rule's job (and a kick's) ends soon after its calls.
    settings.LONGHAUL_GATEWAY_SLICE_SECONDS = 0.2
    monkeypatch.setattr(f"{__name__}.GATEWAY_RUN_FOR", 0.2)
    explore(world, examples=TURNS_EXAMPLES)


def explore(world: dict, *, examples: int) -> None:
    LivenessMachine.world = world
    REACHED.clear()
    run_state_machine_as_test(LivenessMachine, settings=hsettings(
        max_examples=examples,
        stateful_step_count=STEPS,
        deadline=None,
        derandomize=not EXPLORE,
        database=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
        report_multiple_bugs=False,
    ))
    print("\n".join(f"{n:6} {what}" for what, n in sorted(REACHED.items())))



# --- failures the machine found, shrunk and kept as plain sequences -----------------------------------


@pytest.fixture
def machine(world) -> Iterator[LivenessMachine]:
    """The state machine for replaying a sequence by hand; each test ends with the drain and its checks."""
    LivenessMachine.world = world
    replay = LivenessMachine()
    try:
        yield replay
    finally:
        replay.traveller.stop()


def test_a_partial_task_cancelled_keeping_its_results_is_not_repaired_every_sweep(machine):
    """Found by the machine: cancel(keep_results) on a task already `partial` moves it partial -> partial and
    leaves cancel_requested_at set. liveness's stop_request_ignored rule then flags it and each sweep
    "repairs" it the same way: a liveness alert, a new result_version, a new `partial` event and a new
    notification in the thread, every minute, for ever (and find_violations is never empty after a sweep)."""
    machine.submit_sleep(who=0, thread=1, steps=2, side_effect=False, fail=None, fail_at=1, ask_at=None,
                         budget={"max_steps": 1})
    machine.workers_catch_up(rounds=3)
    task = Task.objects.get()
    assert task.status == S.PARTIAL
    machine.cancel(i=0, keep_results=True)
    machine.after_each_rule()
    before = Task.objects.values_list("result_version", "event_version").get()
    for _ in range(3):
        machine.time_passes(seconds=61)
        machine.sweeper_runs()
        machine.workers_catch_up(rounds=3)
        machine.after_each_rule()
    assert Task.objects.get().status == S.PARTIAL
    assert Task.objects.values_list("result_version", "event_version").get() == before
    assert not Alert.objects.filter(kind="liveness").exists()




def run_due_kicks(job: str) -> None:
    """Workers take only the due kicks of one job (`advance`, `operations`, `deliver`, `run`)."""
    for row in due_messages(clock.now()):
        if SignedPackage.loads(row.payload)["func"] == kicks.JOBS[job]:
            take_and_run(row)


def test_a_remote_cancel_waiting_for_its_call_is_not_repaired_as_an_ignored_stop(machine):
    """Found by the machine: a cancelled MCP task whose `tasks/cancel` call is out (here held by a gateway
    job that died; its lease lasts LONGHAUL_OPERATION_LEASE_SECONDS) waits for an unfinished operation, which
    DESIGN §4 allows. liveness's stop_request_ignored flags it after LONGHAUL_LEASE_SECONDS anyway, and the
    repair raises an alert and starts a second round of remote cancellation while the first call is out."""
    machine.submit_mcp(who=0, thread=0, tool=("slow_report", 0.2))
    machine.workers_catch_up(rounds=6)
    machine.cancel(i=0, keep_results=False)
    run_due_kicks("advance")  # the cancel round: it asks for tasks/cancel and waits for it
    assert Operation.objects.filter(name="tasks/cancel", status=OperationStatus.PENDING).exists()
    machine.gateway(dies=True, limit=3)
    machine.after_each_rule()
    machine.time_passes(seconds=31)
    machine.sweeper_runs()
    machine.after_each_rule()
    machine.drain()
