"""Remote MCP tasks on a real qcluster: a worker killed in the middle of a poll (a gateway job running
the tasks/get operation) is replaced, the poll is taken over, and polling goes on without submitting
the tool call again; a worker drained (SIGTERM) while a poll hangs exits within the drain timeout and
another worker runs that poll again."""

from __future__ import annotations

import os
import signal

import pytest
from django.db import connection

from tasks import actions
from tasks.models import Operation, Task
from tasks.statuses import TERMINAL, OperationStatus, TaskStatus
from tasks.supervisor import DRAIN_SECONDS
from tests.acceptance.test_worker_crash import FAST_RECOVERY
from tests.fakes.mcp_task_server import SERVER_NAME, McpTaskServer, calls, write_servers_file
from tests.processes import qcluster, wait_until

pytestmark = [pytest.mark.acceptance, pytest.mark.django_db(transaction=True)]


@pytest.mark.parametrize("transport", ["stdio", "http"])
def test_a_worker_killed_mid_poll_resumes_polling_without_a_second_submission(acme, alice, log_dir, tmp_path,
                                                                             settings, transport):
    state = tmp_path / "state"
    state.mkdir()
    with McpTaskServer(transport=transport, state_dir=state) as server:
        config = str(write_servers_file(tmp_path / "servers.json", server))
        settings.LONGHAUL_MCP_SERVERS = config
        task, _ = actions.submit(tenant=acme, user=alice, submission=actions.Submission(
            kind="mcp", name="render", input={"server": SERVER_NAME, "tool": "slow_report", "arguments": {
                # Each poll takes a while, so a worker can be caught in the middle of one.
                "topic": "renders", "seconds": 8, "poll_ms": 100, "get_delay_ms": 700}}))
        env = {**FAST_RECOVERY, "LONGHAUL_MCP_SERVERS": config, "LONGHAUL_MCP_POLL_FLOOR_MS": "50",
               # A poll whose gateway job died is taken over when its lease runs out; the job's timeout
               # covers its slice plus one lease.
               "LONGHAUL_OPERATION_LEASE_SECONDS": "6", "LONGHAUL_GATEWAY_SLICE_SECONDS": "1",
               "LONGHAUL_Q_TIMEOUT": "10", "LONGHAUL_Q_RETRY": "12"}
        with qcluster(log_dir, workers=2, **env) as cluster:
            def polling_worker() -> tuple[int, int] | None:
                """(pid, operation) of a worker mid-poll: a gateway job running one of the task's tasks/get."""
                connection.close()
                row = (Operation.objects.filter(task=task, name="tasks/get", status=OperationStatus.STARTED)
                       .values("pk", "lease_owner").first())
                if row is None:
                    return None  # not yet past the submission, or between polls
                pid = int(row["lease_owner"].rsplit(":", 1)[1])
                return (pid, row["pk"]) if pid in cluster.descendants() else None

            caught: list[tuple[int, int]] = []

            def catch_one() -> bool:
                found = polling_worker()
                if found:
                    caught.append(found)
                return bool(found)

            wait_until(catch_one, timeout=60, interval=0.05, message="a worker mid-poll")
            os.kill(caught[0][0], signal.SIGKILL)
            wait_until(lambda: Task.objects.get(pk=task.pk).status in TERMINAL, timeout=90, interval=0.3,
                       message="the task to end")
        task.refresh_from_db()
        assert task.status == TaskStatus.SUCCEEDED, (task.error_class, task.error_message)
        assert "renders" in task.result["summary"]
        assert calls(state).get("tools/call:slow_report") == 1, "the tool was submitted once"
        killed_poll = Operation.objects.get(pk=caught[0][1])
        assert killed_poll.attempts == 2 and killed_poll.status == OperationStatus.SUCCEEDED, \
            "the killed poll was taken over"


def test_a_worker_drained_while_a_poll_hangs_exits_in_time_and_the_poll_runs_again_elsewhere(
        acme, alice, log_dir, tmp_path, settings):
    state = tmp_path / "state"
    state.mkdir()
    # Every tasks/get hangs hang_s, longer than a drain may take; the client waits longer still (20 s).
    hang_s = int(1.5 * DRAIN_SECONDS)
    with McpTaskServer(transport="http", state_dir=state, timeout_s=hang_s + 5) as server:
        config = str(write_servers_file(tmp_path / "servers.json", server))
        settings.LONGHAUL_MCP_SERVERS = config
        task, _ = actions.submit(tenant=acme, user=alice, submission=actions.Submission(
            kind="mcp", name="render", input={"server": SERVER_NAME, "tool": "slow_report", "arguments": {
                "topic": "renders", "seconds": 1, "poll_ms": 100, "hang_get_s": hang_s,
                "ttl_ms": 3_600_000}}))
        env = {**FAST_RECOVERY, "LONGHAUL_MCP_SERVERS": config, "LONGHAUL_MCP_POLL_FLOOR_MS": "50",
               "LONGHAUL_OPERATION_LEASE_SECONDS": str(hang_s * 4), "LONGHAUL_GATEWAY_SLICE_SECONDS": "1",
               "LONGHAUL_Q_TIMEOUT": str(hang_s * 6), "LONGHAUL_Q_RETRY": str(hang_s * 7)}
        with qcluster(log_dir, workers=2, **env) as cluster:
            caught: list[tuple[int, int]] = []

            def catch_one() -> bool:
                connection.close()
                row = (Operation.objects.filter(task=task, name="tasks/get", status=OperationStatus.STARTED)
                       .values("pk", "lease_owner").first())
                if row is not None:
                    pid = int(row["lease_owner"].rsplit(":", 1)[1])
                    if pid in cluster.descendants():
                        caught.append((pid, row["pk"]))
                return bool(caught)

            wait_until(catch_one, timeout=60, interval=0.05, message="a worker in the middle of a hanging poll")
            pid, poll = caught[0]
            os.kill(pid, signal.SIGTERM)
            wait_until(lambda: not _alive(pid), timeout=DRAIN_SECONDS, interval=0.1,
                       message="the drained worker to exit within the drain timeout")
            try:
                wait_until(lambda: Task.objects.get(pk=task.pk).status in TERMINAL, timeout=hang_s * 4,
                           interval=0.3, message="the task to end")
            except AssertionError as exc:
                ops = list(Operation.objects.filter(task=task).values_list("key", "status", "attempts", "error_message"))
                raise AssertionError(f"{exc}; {Task.objects.get(pk=task.pk).status}; {ops}") from None
        task.refresh_from_db()
        assert task.status == TaskStatus.SUCCEEDED, (task.error_class, task.error_message)
        assert calls(state).get("tools/call:slow_report") == 1, "the tool was submitted once"
        drained_poll = Operation.objects.get(pk=poll)
        # At least twice: the supervisor replaces the whole cluster when a worker exits, draining the other too.
        assert drained_poll.status == OperationStatus.SUCCEEDED and drained_poll.attempts >= 2, \
            "the poll the drained worker held was run again, under its key, by another worker"
        assert drained_poll.lease_owner == ""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by its parent) has stopped running too.
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False
