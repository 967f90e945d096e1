"""Real processes for acceptance and end-to-end tests: the worker command (a supervised django-q2
cluster) and daphne, pointed at the test database of the running test session."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import quote

from django.db import connection

ROOT = Path(__file__).resolve().parent.parent
# util-linux's setpriv starts a child that Linux sends SIGTERM once the process that started it has died (it then
# execs the child's own program, same pid): a test session or a benchmark killed outright (SIGKILL, an OOM kill,
# a second Ctrl-C) runs no `finally` to stop its clusters and daphnes, which then ran on, holding the test database
# (the next session could not drop it: "being accessed by other users") and the machine's cores.
SETPRIV = shutil.which("setpriv")


def ending_with_us(args: Sequence[str]) -> list[str]:
    """`args`, started so that the process ends (SIGTERM) once this one has died (SETPRIV; as they are without it)."""
    return [SETPRIV, "--pdeathsig", "TERM", *args] if SETPRIV else list(args)


def test_database_url() -> str:
    """The URL of the database this test session uses (test_<name>), for child processes."""
    s = connection.settings_dict
    if connection.vendor == "sqlite":
        return f"sqlite:///{s['NAME']}"
    auth = quote(s["USER"] or "", safe="")
    if s.get("PASSWORD"):
        auth += ":" + quote(s["PASSWORD"], safe="")
    return f"postgres://{auth}@{s['HOST'] or '127.0.0.1'}:{s['PORT'] or 5432}/{s['NAME']}"


def child_env(**overrides: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        DATABASE_URL=test_database_url(),
        LONGHAUL_DEBUG_DRIVERS="1",
        DJANGO_SETTINGS_MODULE="project.settings",
        PYTHONUNBUFFERED="1",
    )
    env.update(overrides)
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Process:
    """A child process in its own process group, with its output in a log file."""

    def __init__(self, name: str, args: list[str], env: dict[str, str], log_dir: Path) -> None:
        log_dir.mkdir(parents=True, exist_ok=True)
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self._log = self.log_path.open("wb")
        self.popen = subprocess.Popen(ending_with_us(args), cwd=ROOT, env=env, stdout=self._log,
                                      stderr=subprocess.STDOUT, start_new_session=True)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def children(self) -> list[int]:
        """Pids of the direct children (qcluster's worker processes live here)."""
        out = subprocess.run(["pgrep", "-P", str(self.pid)], capture_output=True, text=True).stdout
        return [int(p) for p in out.split()]

    def descendants(self) -> list[int]:
        found, frontier = [], [self.pid]
        while frontier:
            pid = frontier.pop()
            out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
            kids = [int(p) for p in out.split()]
            found.extend(kids)
            frontier.extend(kids)
        return found

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int | None:
        """Signal the main process (a qcluster's guard then stops its workers itself), then make sure
        nothing of the group is left."""
        if self.popen.poll() is None:
            self.popen.send_signal(sig)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(10)
        self._log.close()
        return self.popen.returncode

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")


@contextmanager
def qcluster(log_dir: Path, *, workers: int = 2, name: str = "qcluster", command: Sequence[str] = ("worker",),
             chat: bool = True, **env: str) -> Iterator[Process]:
    """The worker service as the Procfile runs it (`manage.py worker`: django-q2's cluster, supervised);
    `command=("qcluster",)` runs django-q2's own command instead. Yields the task cluster; with `chat`, a
    one-worker chat cluster (`worker --queue chat`) runs beside it, for chat runs and notifications."""
    with contextlib.ExitStack() as stack:
        if chat:
            stack.enter_context(chat_cluster(log_dir, name=f"{name}-chat", **env))
        proc = Process(name, [sys.executable, "manage.py", *command],
                       child_env(LONGHAUL_WORKERS=str(workers), **env), log_dir)
        stack.callback(proc.stop)
        yield proc


@contextmanager
def chat_cluster(log_dir: Path, *, workers: int = 1, name: str = "chat", **env: str) -> Iterator[Process]:
    """The chat queue's worker service (`manage.py worker --queue chat`)."""
    proc = Process(name, [sys.executable, "manage.py", "worker", "--queue", "chat"],
                   child_env(LONGHAUL_CHAT_WORKERS=str(workers), **env), log_dir)
    try:
        yield proc
    finally:
        proc.stop()


@contextmanager
def daphne(log_dir: Path, *, port: int | None = None, **env: str) -> Iterator[str]:
    """A daphne serving project.asgi; yields its base URL once /healthz answers."""
    port = port or free_port()
    proc = Process("daphne", [sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", str(port),
                              "project.asgi:application"], child_env(**env), log_dir)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for_http(f"{base}/healthz", proc)
        yield base
    finally:
        proc.stop()


def wait_for_http(url: str, proc: Process, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.popen.poll() is not None:
            raise RuntimeError(f"{proc.name} exited early:\n{proc.output()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"{url} did not answer within {timeout}s:\n{proc.output()[-3000:]}")


def wait_until(predicate, *, timeout: float, interval: float = 0.2, message: str = "condition") -> None:
    """Poll a condition that another process makes true (real processes take real time)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {message}")
