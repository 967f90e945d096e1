"""The `longhaul` command and longhaul.client against a real daphne and worker.

The command runs as the installed console script in its own process, with its own config
directory, as a person or a script would run it.
"""

from __future__ import annotations

import ctypes
import json
import os
import queue
import signal
import socket
import stat
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from rest_framework.authtoken.models import Token
from websockets.sync.client import connect

from longhaul.client import Client, ConnectionFailed
from tasks.models import Task
from tasks.statuses import TERMINAL, TaskStatus
from tests.factories import make_task, submit_sleep
from tests.processes import daphne, ending_with_us, free_port, qcluster

pytestmark = [pytest.mark.acceptance, pytest.mark.django_db(transaction=True)]
LONGHAUL = Path(sys.executable).parent / "longhaul"
QUESTION = "How does asyncio task cancellation work?"
WAIT = 90  # seconds for a research task to be watched to its end; never slept


@pytest.fixture
def token(alice) -> str:
    return Token.objects.get_or_create(user=alice)[0].key


@pytest.fixture
def home(tmp_path) -> dict[str, str]:
    """The command's environment: a config directory of its own and nothing from the test session."""
    return {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "XDG_CONFIG_HOME": str(tmp_path / "config"),
            "COLUMNS": "200"}


def longhaul(*args: str, env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(LONGHAUL), *args], env=env, capture_output=True, text=True, timeout=timeout,
                          check=False)


def one_line(stream: str) -> str:
    lines = stream.strip().splitlines()
    assert len(lines) == 1, f"expected one line, got {lines}"
    return lines[0]


class Lines:
    """A running command whose stdout is read line by line, with a deadline."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        # As a person starts it from a terminal: with SIGINT at its default (env --default-signal), which Python
        # turns into KeyboardInterrupt. A test session started in the background (`make test &` in a script)
        # inherits SIGINT ignored, and Python keeps it so: Ctrl-C would do nothing. PYTHONFAULTHANDLER: a command
        # that outlives its deadline is stopped with SIGABRT, which then writes where each of its threads was to
        # stderr (finish).
        command = ending_with_us(["env", "--default-signal=INT", str(LONGHAUL), *args])
        self.popen = subprocess.Popen(command, env={**env, "PYTHONFAULTHANDLER": "1"}, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True)
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def next_json(self, timeout: float) -> dict[str, Any]:
        line = self._lines.get(timeout=timeout)
        assert line is not None, f"the command ended early: {self.finish()}"
        return json.loads(line)

    def finish(self, timeout: float = 30) -> tuple[int, str]:
        assert self.popen.stderr is not None
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.popen.send_signal(signal.SIGABRT)
            pytest.fail(f"the command was still running after {timeout:g} s; its stderr, then where its threads "
                        f"were:\n{self.popen.stderr.read()}")  # read to its end: the process has ended
        return self.popen.returncode, self.popen.stderr.read()


# --- a research task, end to end ---------------------------------------------------------

def test_it_submits_research_watches_it_across_forced_reconnects_and_prints_the_report(
        alice, token, home, log_dir):
    port = free_port()
    with daphne(log_dir, port=port) as base:
        signed_in = longhaul("login", base, "--token", token, env=home)
        assert signed_in.returncode == 0, signed_in.stderr
        config = Path(home["XDG_CONFIG_HOME"]) / "longhaul" / "config.json"
        assert stat.S_IMODE(config.stat().st_mode) == 0o600
        assert json.loads(config.read_text()) == {"url": base, "token": token}

        submitted = longhaul("research", QUESTION, "--json", env=home)
        assert submitted.returncode == 0, submitted.stderr
        task_id = json.loads(submitted.stdout)["id"]
        # No worker yet: the watch sees the task queued and admitted, then waits.
        watch = Lines(["--verbose", "watch", task_id, "--json"], env=home)
        received = [watch.next_json(WAIT), watch.next_json(WAIT)]
    # Forced reconnect 1: the server goes away under the watch and comes back on the same port.
    with daphne(log_dir, port=port), qcluster(log_dir, workers=1, LONGHAUL_OFFLINE_LATENCY_MS="300"):
        while "seq" not in received[-1] or received[-1]["kind"] != "searching":
            received.append(watch.next_json(WAIT))
    # Forced reconnect 2: in the middle of the run, while the worker keeps going.
    with daphne(log_dir, port=port), qcluster(log_dir, workers=1, name="qcluster-2"):
        while received[-1].get("type") != "end":
            received.append(watch.next_json(WAIT))
        code, stderr = watch.finish()
        report = longhaul("result", task_id, env=home)

    task = Task.objects.get(public_id=task_id)
    assert task.status == TaskStatus.SUCCEEDED
    assert [m["seq"] for m in received[:-1]] == list(range(1, task.last_event_seq + 1)), "each event exactly once"
    assert received[-1] == {"type": "end", "status": "succeeded", "result_version": 1, "question": ""}
    assert code == 0, stderr
    assert "retrying" in stderr or "trying again" in stderr, stderr  # it saw the server go, and kept watching
    assert report.returncode == 0, report.stderr
    assert report.stdout == task.result["report"]
    assert "## Sources" in report.stdout and "[1]" in report.stdout


def test_it_waits_for_research_showing_progress_on_stderr_and_the_report_on_stdout(alice, token, home, log_dir):
    with daphne(log_dir) as base, qcluster(log_dir, workers=1):
        env = {**home, "LONGHAUL_URL": base, "LONGHAUL_TOKEN": token}
        done = longhaul("research", QUESTION, "--wait", env=env, timeout=WAIT)
    assert done.returncode == 0, done.stderr
    task = Task.objects.get()
    assert done.stdout == task.result["report"]
    assert "source_read" in done.stderr and "evidence_added" in done.stderr
    assert f"{task.public_id} succeeded" in done.stderr


def test_it_follows_a_task_over_the_websocket_with_a_token(acme, alice, token, log_dir):
    task = make_task(acme, alice, status=TaskStatus.SUCCEEDED, last_event_seq=0, result_version=0)
    with daphne(log_dir) as base, Client(base, token, use_websocket=True) as client:
        follow = client.follow(str(task.public_id))
        assert list(follow) == []
        assert follow.end == {"type": "end", "status": "succeeded", "result_version": 0}
        assert follow.transport == "websocket" and follow.connections == 1


def test_a_client_over_its_live_stream_limit_polls_instead_of_reconnecting(acme, alice, token, log_dir):
    held = submit_sleep(acme, alice)  # queued, with its first event; no worker takes it
    task = make_task(acme, alice, status=TaskStatus.SUCCEEDED, last_event_seq=0, result_version=0)
    with daphne(log_dir, LONGHAUL_WS_MAX_PER_USER="1") as base:
        # The user's one live stream, held open by another client.
        with connect(f"ws{base[4:]}/ws/tasks/{held.public_id}/", origin=base,
                     additional_headers={"Authorization": f"Token {token}"}) as holder:
            assert json.loads(holder.recv(timeout=10))["seq"] == 1  # authorized: it holds the slot
            with Client(base, token, use_websocket=True) as client:
                follow = client.follow(str(task.public_id))
                events: list[Any] = []
                reader = threading.Thread(target=lambda: events.extend(follow), daemon=True)
                reader.start()
                reader.join(WAIT)  # a client that kept reconnecting would never get here
                assert not reader.is_alive(), f"still following after {WAIT} s ({follow.connections} sockets)"
    assert events == []
    assert follow.end == {"type": "end", "status": "succeeded", "result_version": 0}
    assert follow.transport == "polling" and follow.connections == 1


def test_ctrl_c_stops_the_watch_and_leaves_the_task_running(acme, alice, token, home, log_dir):
    task = submit_sleep(acme, alice, steps=3)
    with daphne(log_dir) as base:
        watch = Lines(["watch", str(task.public_id), "--json"],
                      env={**home, "LONGHAUL_URL": base, "LONGHAUL_TOKEN": token})
        assert watch.next_json(WAIT)["kind"] == "queued"
        watch.popen.send_signal(signal.SIGINT)
        code, stderr = watch.finish()
    assert code == 130
    assert f"the task goes on. Resume with: longhaul watch {task.public_id} --after " in stderr
    task.refresh_from_db()
    assert task.status not in TERMINAL and task.cancel_requested_at is None


def signal_thread(pid: int, tid: int, sig: int) -> None:
    """Send `sig` to thread `tid` of process `pid` alone (tgkill), as the kernel may give a process's signal."""
    if ctypes.CDLL(None, use_errno=True).tgkill(pid, tid, sig) != 0:
        raise OSError(ctypes.get_errno(), f"tgkill {pid} {tid}")


def test_a_ctrl_c_the_kernel_gives_to_the_streams_thread_stops_the_watch(acme, alice, token, home, log_dir):
    """Python runs the SIGINT handler on the main thread, between two of its bytecodes, and the kernel may give a
    process's signal to any of its threads, or as its main thread is about to wait: that thread, waiting for the next
    event with no timeout, waited on for one that a queued task does not send for a while."""
    task = submit_sleep(acme, alice, steps=3)
    with daphne(log_dir) as base:
        watch = Lines(["watch", str(task.public_id), "--json"],
                      env={**home, "LONGHAUL_URL": base, "LONGHAUL_TOKEN": token})
        assert watch.next_json(WAIT)["kind"] == "queued"  # its stream's thread runs
        pid = watch.popen.pid
        others = [int(tid) for tid in os.listdir(f"/proc/{pid}/task") if int(tid) != pid]
        assert others, "the stream is followed on a thread of its own"
        signal_thread(pid, others[0], signal.SIGINT)
        code, stderr = watch.finish()
    assert code == 130
    assert f"the task goes on. Resume with: longhaul watch {task.public_id} --after " in stderr


# --- one clear line and a non-zero exit ---------------------------------------------------

def test_it_refuses_a_bad_token_in_one_line(alice, home, log_dir):
    with daphne(log_dir) as base:
        login = longhaul("login", base, "--token", "not-a-token", env=home)
        env = {**home, "LONGHAUL_URL": base, "LONGHAUL_TOKEN": "not-a-token"}
        listing = longhaul("list", env=env)
        scripted = longhaul("list", "--json", env=env)
    assert login.returncode == 6
    assert "Invalid token" in one_line(login.stderr) and "not_authenticated" in login.stderr
    assert not (Path(home["XDG_CONFIG_HOME"]) / "longhaul" / "config.json").exists(), "a refused token was kept"
    assert listing.returncode == 6
    assert listing.stdout == ""
    assert "longhaul login" in one_line(listing.stderr)
    assert scripted.returncode == 6
    assert json.loads(one_line(scripted.stderr))["code"] == "not_authenticated"


def test_it_says_an_unknown_id_or_name_is_not_found_in_one_line(alice, token, home, log_dir):
    with daphne(log_dir) as base:
        env = {**home, "LONGHAUL_URL": base, "LONGHAUL_TOKEN": token}
        unknown_id = str(uuid.uuid4())
        watched = longhaul("watch", unknown_id, env=env)
        cancelled = longhaul("cancel", "no task is called this", "--json", env=env)
    assert watched.returncode == 7
    assert unknown_id in one_line(watched.stderr)
    assert cancelled.returncode == 7
    assert json.loads(one_line(cancelled.stderr))["code"] == "not_found"


def test_it_says_the_server_cannot_be_reached_in_one_line(home):
    closed = f"http://127.0.0.1:{free_port()}"  # bound and released: nothing listens there
    listing = longhaul("list", env={**home, "LONGHAUL_URL": closed, "LONGHAUL_TOKEN": "x"})
    result = longhaul("result", str(uuid.uuid4()), "--json", env={**home, "LONGHAUL_URL": closed,
                                                                   "LONGHAUL_TOKEN": "x"})
    assert listing.returncode == 9
    assert f"cannot reach {closed}" in one_line(listing.stderr)
    assert result.returncode == 9
    assert json.loads(one_line(result.stderr))["code"] == "connection_failed"


def test_it_refuses_an_answer_to_a_task_that_asks_nothing(acme, alice, token, home, log_dir):
    task = make_task(acme, alice, status=TaskStatus.RUNNING)
    with daphne(log_dir) as base:
        answered = longhaul("answer", str(task.public_id), "yes", "--json",
                            env={**home, "LONGHAUL_URL": base, "LONGHAUL_TOKEN": token})
    assert answered.returncode == 8
    assert json.loads(one_line(answered.stderr))["code"] == "not_waiting"


def test_it_deletes_an_ended_task_and_refuses_a_running_one(acme, alice, token, home, log_dir):
    ended = make_task(acme, alice, status=TaskStatus.SUCCEEDED, name="old report")
    running = make_task(acme, alice, status=TaskStatus.RUNNING, name="live report")
    env = {**home, "LONGHAUL_TOKEN": token}
    with daphne(log_dir) as base:
        env["LONGHAUL_URL"] = base
        deleted = longhaul("delete", "old report", "--json", env=env)
        refused = longhaul("delete", str(running.public_id), env=env)
        again = longhaul("delete", str(ended.public_id), env=env)
    assert deleted.returncode == 0, deleted.stderr
    assert json.loads(deleted.stdout) == {"deleted": str(ended.public_id)}
    assert not Task.objects.filter(pk=ended.pk).exists()
    assert refused.returncode == 8 and "cancel it first" in one_line(refused.stderr)
    assert Task.objects.filter(pk=running.pk).exists()
    assert again.returncode == 7


# --- names -----------------------------------------------------------------------------------

def test_it_cancels_by_name_and_lists_the_candidates_of_an_ambiguous_one(acme, alice, bob, token, home, log_dir):
    twins = [make_task(acme, alice, status=TaskStatus.RUNNING, name="nightly digest") for _ in range(2)]
    only = make_task(acme, alice, status=TaskStatus.RUNNING, name="weekly digest")
    make_task(acme, alice, status=TaskStatus.SUCCEEDED, name="weekly digest")  # ended: not a candidate
    make_task(acme, bob, status=TaskStatus.RUNNING, name="weekly digest")  # bob's: alice cannot see it
    with daphne(log_dir) as base:
        env = {**home, "LONGHAUL_URL": base, "LONGHAUL_TOKEN": token}
        ambiguous = longhaul("cancel", "nightly digest", env=env)
        cancelled = longhaul("cancel", "weekly digest", "--reason", "not needed", "--json", env=env)
        listed = longhaul("list", "--json", env=env)
    assert ambiguous.returncode == 2
    line = one_line(ambiguous.stderr)
    assert all(str(t.public_id) in line for t in twins), line
    assert cancelled.returncode == 0, cancelled.stderr
    assert json.loads(cancelled.stdout)["id"] == str(only.public_id)
    only.refresh_from_db()
    assert only.cancel_requested_at is not None
    assert all(Task.objects.get(pk=t.pk).cancel_requested_at is None for t in twins)
    assert {t["name"] for t in json.loads(listed.stdout)} == {"nightly digest", "weekly digest"}


# --- the client library ------------------------------------------------------------------------

@contextmanager
def response_dropping_proxy(upstream_port: int) -> Iterator[str]:
    """A TCP proxy that hands the first request to the server and drops the connection before the
    answer reaches the client (a lost response); later connections pass through untouched."""
    listener = socket.create_server(("127.0.0.1", 0))
    dropped = threading.Event()

    def pipe(source: socket.socket, target: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                target.sendall(data)
        except OSError:
            pass
        finally:
            for s in (source, target):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def serve(client: socket.socket) -> None:
        upstream = socket.create_connection(("127.0.0.1", upstream_port))
        if not dropped.is_set():
            dropped.set()
            request = client.recv(65536)
            head, _, body = request.partition(b"\r\n\r\n")
            length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), 0)
            while len(body) < length:
                body += client.recv(65536)
            upstream.sendall(head + b"\r\n\r\n" + body)
            upstream.recv(65536)  # the server has answered: the task exists
            client.close()
            upstream.close()
            return
        threading.Thread(target=pipe, args=(client, upstream), daemon=True).start()
        pipe(upstream, client)

    def accept() -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(client,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        listener.close()


def test_it_retries_a_submit_whose_answer_was_lost_with_the_same_idempotency_key(acme, alice, token, log_dir):
    port = free_port()
    with (daphne(log_dir, port=port), response_dropping_proxy(port) as proxied,
          Client(proxied, token, backoff=0.1) as client):
        task = client.submit("sleep", {"steps": 1}, name="once")
    assert Task.objects.count() == 1, "the retry made a second task"
    assert task["id"] == str(Task.objects.get().public_id)


def test_it_does_not_resend_an_answer_whose_response_was_lost(acme, alice, token, log_dir):
    task = make_task(acme, alice, status=TaskStatus.RUNNING)
    port = free_port()
    with (daphne(log_dir, port=port), response_dropping_proxy(port) as proxied,
          Client(proxied, token, backoff=0.1) as client, pytest.raises(ConnectionFailed)):
        client.answer(str(task.public_id), "yes")


