"""One execution model (DESIGN §4): a step never waits on the network, whatever its driver.

Every model, tool and MCP call is an Operation that a gateway job runs; a step only reads
outcomes and requests calls, and telling a remote server to stop is a call requested in the
fenced transaction that ends (or cancels) the task.
"""

from __future__ import annotations

import inspect
import socket
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from unittest import mock

import pytest
import time_machine
from django.conf import settings as django_settings
from django.db import connection
from django_q.models import OrmQ

from tasks import actions, clock, jobs, leases, operations, runner
from tasks.mcp import client, config, sessions
from tasks.models import Checkpoint, Operation, SleepEffect, Task, TaskEvent
from tasks.statuses import TERMINAL, OperationStatus, TaskStatus
from tests.fakes.mcp_task_server import SERVER_NAME, McpTaskServer, calls, write_servers_file

# Transactional: the heartbeat thread renews leases on its own connection and must see the rows.
pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def _fast(settings):
    settings.LONGHAUL_STEP_SLICE_MS = 0
    settings.LONGHAUL_DEBUG_DRIVERS = True
    settings.LONGHAUL_MCP_POLL_FLOOR_MS = 50
    settings.LONGHAUL_MCP_BACKOFF_CAP_SECONDS = 0.4
    settings.LONGHAUL_MCP_CANCEL_CONFIRM_SECONDS = 5


@pytest.fixture
def remote(tmp_path, settings) -> Iterator[Path]:
    """The fake MCP server over HTTP on loopback; yields its state dir (calls.json counts every request)."""
    state = tmp_path / "state"
    state.mkdir()
    with McpTaskServer(transport="http", state_dir=state) as server:
        settings.LONGHAUL_MCP_SERVERS = str(write_servers_file(tmp_path / "servers.json", server))
        yield state


@contextmanager
def network_refused() -> Iterator[list[str]]:
    """In this thread only: refuse, and note, every outgoing connection, every process spawned (an MCP
    server over stdio) and every request handed to the MCP sessions' own thread (which talks to the
    servers for the whole process). Other threads (the heartbeat's database connection) are left alone."""
    mine = threading.get_ident()
    tried: list[str] = []

    def refusing(what: str, real: Callable) -> Callable:
        def call(*args, **kwargs):
            if threading.get_ident() != mine:
                return real(*args, **kwargs)
            for arg in args:
                if inspect.iscoroutine(arg):
                    arg.close()  # never awaited: it was refused
            tried.append(what)
            raise ConnectionRefusedError(f"a step tried to reach the network ({what})")
        return call

    with mock.patch.object(socket.socket, "connect", refusing("connect", socket.socket.connect)), \
            mock.patch.object(socket.socket, "connect_ex", refusing("connect_ex", socket.socket.connect_ex)), \
            mock.patch.object(socket, "create_connection", refusing("create_connection", socket.create_connection)), \
            mock.patch.object(subprocess.Popen, "_execute_child",
                              refusing("spawn", subprocess.Popen._execute_child)), \
            mock.patch.object(sessions, "run_sync", refusing("mcp session", sessions.run_sync)), \
            mock.patch.object(sessions, "run", refusing("mcp session", sessions.run)):
        yield tried


def ended(task: Task) -> bool:
    return task.status in TERMINAL


def run(task: Task, *, until: Callable[[Task], bool] = ended, step: Callable[[int], None] = jobs.advance,
        timeout: float = 60) -> Task:
    """Run the task as a cluster would: steps (through `step`) when due, gateway jobs when calls are due."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        task.refresh_from_db()
        calls_due = operations.due_exists(clock.now())
        if until(task) and not calls_due:
            return task
        if calls_due:
            operations.run_due(run_for=0.1)
        elif task.status in (TaskStatus.RUNNING, TaskStatus.RETRY_WAIT) and task.next_run_at \
                and task.next_run_at <= clock.now():
            step(task.pk)
        else:
            time.sleep(0.02)
    raise AssertionError(f"still {task.status} ({task.waiting_reason}) after {timeout} s")


def submit(tenant, user, kind: str, input: dict, **extra) -> Task:
    task, _ = actions.submit(tenant=tenant, user=user, submission=actions.Submission(
        kind=kind, name=f"{kind} job", input=input, **extra))
    return task


def submit_mcp(tenant, user, tool: str, **arguments) -> Task:
    return submit(tenant, user, "mcp", {"server": SERVER_NAME, "tool": tool, "arguments": {"poll_ms": 100,
                                                                                         **arguments}})


def kinds(task: Task) -> list[str]:
    return list(TaskEvent.objects.filter(task=task).order_by("seq").values_list("kind", flat=True))


# --- (1) no driver and not the runner performs network I/O --------------------------------------


def test_the_refusal_catches_a_call_to_an_mcp_server():
    """The guard itself: an MCP request made in the refusing thread is refused, and noted."""
    config = client.ServerConfig(name="x", transport="http", url="http://127.0.0.1:9/mcp", timeout_s=5)
    with network_refused() as tried, pytest.raises((client.McpError, ConnectionRefusedError)):
        client.get_task(config, "0123456789abcdef")
    assert tried


def test_steps_of_every_driver_finish_with_the_network_refused(remote, acme, alice):
    refused: list[str] = []

    def offline_step(task_id: int) -> None:
        with network_refused() as tried:
            jobs.advance(task_id)
        refused.extend(tried)

    sleeper = run(submit(acme, alice, "sleep", {"steps": 3, "side_effect": True}), step=offline_step)
    research = run(submit(acme, alice, "research", {"question": "How does asyncio task cancellation work?"}),
                   step=offline_step)
    answered = run(submit_mcp(acme, alice, "approval_job", seconds=0.2),
                   until=lambda t: t.status == TaskStatus.WAITING_INPUT or ended(t), step=offline_step)
    actions.answer(answered, user=alice, text="pdf")
    answered = run(answered, step=offline_step)
    cancelled = run(submit_mcp(acme, alice, "slow_report", topic="t", seconds=30),
                    until=lambda t: t.current_step >= 2, step=offline_step)
    actions.request_cancel(cancelled, user=alice)
    cancelled = run(cancelled, step=offline_step)
    out_of_time = run(submit(acme, alice, "mcp", {"server": SERVER_NAME, "tool": "slow_report", "arguments": {
        "topic": "t", "seconds": 60, "poll_ms": 100}}, budget={"max_wall_seconds": 1}), step=offline_step)

    assert refused == [], "a step tried to reach the network"
    assert sleeper.status == TaskStatus.SUCCEEDED and SleepEffect.objects.filter(task=sleeper).count() == 3
    assert research.status == TaskStatus.SUCCEEDED, (research.error_class, research.error_message)
    assert answered.status == TaskStatus.SUCCEEDED and "report in pdf" in answered.result["summary"]
    assert cancelled.status == TaskStatus.CANCELLED
    assert out_of_time.status == TaskStatus.FAILED and out_of_time.error_class == "budget_exhausted"
    made = calls(remote)
    assert made["tools/call:approval_job"] == 1 and made["tools/call:slow_report"] == 2
    assert made["tasks/update"] == 1, "the answer went out, from a gateway job"
    assert made["tasks/cancel"] == 2, "the cancel round and the abandon went out, from a gateway job"
    assert made["tasks/get"] >= 4


# --- (2) finding 6: a worker fenced out stops nothing -----------------------------------------------


def polling_task(acme, alice) -> Task:
    """An MCP task whose remote job works, due for its next step (its first poll has answered)."""
    task = run(submit_mcp(acme, alice, "slow_report", topic="t", seconds=60), until=lambda t: t.current_step >= 2)
    return run(task, until=lambda t: t.status == TaskStatus.RUNNING and t.next_run_at is not None)


def taken_over(task: Task) -> tuple[Task, Task]:
    """Worker A claims the task; its lease expires and worker B claims it: (A's view, B's view)."""
    now = clock.now()
    stale = leases.claim(task.pk, owner="worker-a:1", now=now)
    assert stale is not None
    later = now + timedelta(seconds=django_settings.LONGHAUL_LEASE_SECONDS + 1)
    holder = leases.claim(task.pk, owner="worker-b:2", now=later)
    assert holder is not None and holder.fencing_token == stale.fencing_token + 1
    return stale, holder


def footprint(task: Task) -> dict:
    fresh = Task.objects.get(pk=task.pk)
    return {
        "row": (fresh.status, fresh.version, fresh.fencing_token, fresh.lease_owner, fresh.error_class),
        "events": TaskEvent.objects.filter(task=task).count(),
        "checkpoints": Checkpoint.objects.filter(task=task).count(),
        "operations": sorted(Operation.objects.filter(task=task).values_list("key", "status")),
        "kicks": OrmQ.objects.count(),
    }


def test_a_worker_fenced_out_that_runs_out_of_budget_sends_no_cancel_and_writes_nothing(remote, acme, alice):
    task = polling_task(acme, alice)
    Task.objects.filter(pk=task.pk).update(budget={**task.budget, "max_wall_seconds": 1},
                                           started_at=clock.now() - timedelta(hours=1))
    stale, holder = taken_over(task)
    before = footprint(task)

    runner.run(stale, owner="worker-a:1")  # its budget check ends the task: fenced, it loses

    assert footprint(task) == before, "the stale worker wrote nothing"
    operations.run_due(run_for=0.1)
    assert calls(remote).get("tasks/cancel", 0) == 0, "nor did it stop its successor's remote job"

    runner.run(holder, owner="worker-b:2")  # the holder ends it, and stops the remote job once
    task = run(task)
    assert task.status == TaskStatus.FAILED and task.error_class == "budget_exhausted"
    assert calls(remote)["tasks/cancel"] == 1
    assert client.get_task(server_config(), remote_id(task)).status == "cancelled"


def test_a_worker_fenced_out_that_fails_the_task_sends_no_cancel_and_writes_nothing(remote, acme, alice, settings):
    task = polling_task(acme, alice)
    stale, holder = taken_over(task)
    stale.attempts = settings.LONGHAUL_MAX_ATTEMPTS + 1  # what it read makes it end the task as poison
    before = footprint(task)

    runner.run(stale, owner="worker-a:1")

    assert footprint(task) == before, "the stale worker wrote nothing"
    operations.run_due(run_for=0.1)
    assert calls(remote).get("tasks/cancel", 0) == 0
    assert Task.objects.get(pk=task.pk).lease_owner == "worker-b:2", "the holder goes on"


def server_config() -> client.ServerConfig:
    return config.servers()[SERVER_NAME].config


def remote_id(task: Task) -> str:
    return Checkpoint.objects.filter(task=task).order_by("-step").first().state["remote"]


# --- (3) every MCP call is an operation a gateway job ran, each at most once ---------------------------


def test_an_mcp_tasks_calls_are_gateway_operations_each_run_once(remote, acme, alice):
    answered = run(submit_mcp(acme, alice, "approval_job", seconds=0.2),
                   until=lambda t: t.status == TaskStatus.WAITING_INPUT)
    actions.answer(answered, user=alice, text="html")
    answered = run(answered)
    cancelled = run(submit_mcp(acme, alice, "slow_report", topic="t", seconds=30),
                    until=lambda t: t.current_step >= 2)
    actions.request_cancel(cancelled, user=alice)
    cancelled = run(cancelled)
    assert answered.status == TaskStatus.SUCCEEDED and cancelled.status == TaskStatus.CANCELLED

    ops = list(Operation.objects.filter(task__in=[answered, cancelled]))
    assert {op.mode for op in ops} == {Operation.Mode.GATEWAY}
    assert {op.kind for op in ops} == {"mcp"}
    assert len({op.key for op in ops}) == len(ops)
    ran = [op for op in ops if op.attempts]
    assert all(op.attempts == 1 for op in ran), [(op.key, op.attempts) for op in ran if op.attempts != 1]
    assert all("duration_ms" in op.usage for op in ran), "each was run by a gateway job"
    assert {op.status for op in ran} <= {OperationStatus.SUCCEEDED, OperationStatus.FAILED}
    # The slow poll watching the remote task while the question waited was never run: the answer made it
    # needless, and it was closed. A poll still due when the cancel came (whether one was depends on how
    # fast the gateway ran) was closed with its task, never run.
    never_ran = [(op.task_id == answered.pk, operations.is_watch(op.key), op.name, op.status, op.error_class)
                 for op in ops if not op.attempts]
    assert [r for r in never_ran if r[0]] == [(True, True, "tasks/get", OperationStatus.FAILED, "cancelled")]
    assert {r for r in never_ran if not r[0]} <= {(False, False, "tasks/get", OperationStatus.FAILED, "cancelled")}
    by_task = {task: Counter(op.name for op in ran if op.task_id == task.pk) for task in (answered, cancelled)}
    assert by_task[answered]["tools/call"] == 1 and by_task[answered]["tasks/update"] == 1
    assert by_task[answered]["tasks/get"] >= 2
    assert by_task[cancelled]["tools/call"] == 1 and by_task[cancelled]["tasks/cancel"] == 1
    assert by_task[cancelled]["tasks/get"] >= 1, "the cancel round polls until the remote says cancelled"
    made = calls(remote)
    assert made["tools/call:approval_job"] == 1 and made["tools/call:slow_report"] == 1
    assert made["tasks/update"] == 1 and made["tasks/cancel"] == 1
    assert made["tasks/get"] == sum(c["tasks/get"] for c in by_task.values()), "every poll was an operation"
    assert not Operation.objects.filter(task__in=[answered, cancelled], mode=Operation.Mode.LOCAL).exists()


def test_polls_that_learn_nothing_count_no_step_and_write_no_checkpoint(remote, acme, alice):
    task = run(submit(acme, alice, "mcp", {"server": SERVER_NAME, "tool": "slow_report", "arguments": {
        "topic": "t", "seconds": 4, "poll_ms": 50}}, budget={"max_steps": 3}))
    assert task.status == TaskStatus.SUCCEEDED, "a remote task is bounded by its wall time, not its steps"
    polls = Operation.objects.filter(task=task, name="tasks/get").count()
    steps = task.current_step
    # Steps: the submission, its handle, 4 progress messages, the end; however many polls it took.
    assert steps <= 8 and polls >= steps + 4, (polls, steps)
    assert Checkpoint.objects.filter(task=task).count() <= steps


# --- (4) a gateway job that died mid tools/call --------------------------------------------------------


def test_a_tools_call_whose_gateway_job_died_is_not_called_again_and_fails_the_task(remote, acme, alice, settings):
    task = submit_mcp(acme, alice, "slow_report", topic="t", seconds=1)
    jobs.advance(task.pk)  # the first step requests the tools/call
    [call] = operations.claim_batch(owner="gateway-that-dies:1", limit=10, now=clock.now())
    assert call.name == "tools/call" and call.has_side_effects
    # The job is killed before it calls (or while it calls: MCP cannot tell which). Its lease runs out.
    later = clock.now() + timedelta(seconds=settings.LONGHAUL_OPERATION_LEASE_SECONDS + 1)
    with time_machine.travel(later, tick=True):
        assert operations.due_exists(clock.now()), "the sweeper would kick a gateway job for it"
        assert operations.claim_batch(owner="gateway:2", limit=10, now=clock.now()) == [], "not run again"
        task = run(task)

    assert task.status == TaskStatus.FAILED
    assert "may or may not have started" in task.error_message
    assert calls(remote).get("tools/call:slow_report", 0) == 0
    call.refresh_from_db()
    assert call.status == OperationStatus.FAILED and call.attempts == 1
    assert "remote_started" not in kinds(task)


# --- one event loop, many MCP calls in flight ----------------------------------------------------------


def test_a_gateway_job_keeps_an_mcp_servers_calls_in_flight_together_up_to_its_limit(remote, acme, alice, settings):
    settings.LONGHAUL_MCP_CONCURRENCY = 4
    acme.max_running = 8
    acme.save()
    polling = [submit_mcp(acme, alice, "slow_report", topic=f"t{n}", seconds=60, get_delay_ms=800) for n in range(8)]
    for task in polling:
        jobs.advance(task.pk)  # requests its tools/call
    operations.run_due(run_for=10)
    for task in polling:
        jobs.advance(task.pk)  # reads its handle, requests its first poll
    polls = Operation.objects.filter(task__in=polling, name="tasks/get")
    assert polls.count() == 8
    while polls.filter(not_before__gt=clock.now()).exists():
        time.sleep(0.02)

    def gateway_job() -> None:
        try:
            operations.run_due(run_for=5)
        finally:
            connection.close()

    job = threading.Thread(target=gateway_job)
    started = time.monotonic()
    job.start()
    in_flight = []
    while job.is_alive():
        in_flight.append(polls.filter(status=OperationStatus.STARTED).count())
        time.sleep(0.05)
    elapsed = time.monotonic() - started

    assert max(in_flight) == 4, in_flight
    assert polls.filter(status=OperationStatus.SUCCEEDED).count() == 8
    assert calls(remote)["tasks/get"] == 8
    assert elapsed < 8 * 0.8, f"{elapsed:.1f} s: the polls (0.8 s each) ran side by side, not one after another"


# --- a gateway job's lease watchdog -------------------------------------------------------------------


def test_a_gateway_job_keeps_one_watchdog_kick_for_its_calls_leases_and_withdraws_it_when_it_ends_well(settings):
    settings.LONGHAUL_OPERATION_LEASE_SECONDS = 30
    watchdog = operations.Watchdog()
    now = clock.now()
    watchdog.cover(now)
    [kick] = OrmQ.objects.all()
    assert kick.lock >= now + timedelta(seconds=30), "if the job dies, the next one looks when the leases ran out"
    watchdog.cover(now + timedelta(seconds=1))  # a claim a second later is still covered
    assert list(OrmQ.objects.values_list("pk", flat=True)) == [kick.pk]
    watchdog.cover(now + timedelta(seconds=10))  # a later claim moves it
    [moved] = OrmQ.objects.all()
    assert moved.lock >= now + timedelta(seconds=40)
    watchdog.withdraw()
    assert not OrmQ.objects.exists()
