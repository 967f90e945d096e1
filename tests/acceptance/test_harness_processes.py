"""The processes tests and benchmarks start (tests/processes.py) end with whoever started them: a session killed
outright runs no `finally` to stop them, and they ran on, holding the test database and the machine's cores."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.processes import ROOT, SETPRIV, wait_until

pytestmark = pytest.mark.acceptance

# A stand-in for a test session: it starts a long-lived child through the harness, says its pid, and waits.
SESSION = """
import sys, time
from pathlib import Path
from tests.processes import Process
child = Process("sleeper", [sys.executable, "-c", "import time; time.sleep(600)"], {}, Path(sys.argv[1]))
# Once the child runs its own program (not a program that starts it, whose arguments name this one's too), whatever
# starts it has set it up to end with this process. A child that never gets there: no pid said, and the test fails.
deadline = time.monotonic() + 30
while Path(f"/proc/{child.pid}/exe").resolve() != Path(sys.executable).resolve():
    if time.monotonic() > deadline:
        sys.exit("the child never ran its own program")
    time.sleep(0.01)
print(child.pid, flush=True)
time.sleep(600)
"""


def alive(pid: int) -> bool:
    """Whether `pid` runs: a process that has died but is not yet reaped (a zombie) does not."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.skipif(SETPRIV is None, reason="setpriv (util-linux) is not installed: children outlive their starter")
def test_a_child_the_harness_started_ends_when_the_session_that_started_it_is_killed(tmp_path):
    session = subprocess.Popen([sys.executable, "-c", SESSION, str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE,
                               text=True)
    try:
        assert session.stdout is not None
        child = int(session.stdout.readline())
        assert alive(child)
    finally:
        session.send_signal(signal.SIGKILL)
        session.wait(10)
    wait_until(lambda: not alive(child), timeout=10, message=f"the child {child} to end with its session")
