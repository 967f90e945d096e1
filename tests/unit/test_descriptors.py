"""A gateway job's cap on calls out against the process's open-file limit (tasks/descriptors.py), each case
in a fresh interpreter that sets its limits first: lowering a hard limit cannot be undone."""

from __future__ import annotations

import json
import resource
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Sets the limits (soft, hard) given as arguments, then prints the calls a job may keep out under a cap of 1,000
# (asked twice) and the soft limit afterwards; the warning goes to stderr.
PROBE = """
import json, logging, resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[1]), int(sys.argv[2])))
logging.basicConfig(level=logging.WARNING)
from tasks.descriptors import calls_at_most
first, again = calls_at_most(1000), calls_at_most(1000)
print(json.dumps([first, again, resource.getrlimit(resource.RLIMIT_NOFILE)[0]]))
"""


def probe(soft: int, hard: int) -> tuple[int, int, int, str]:
    done = subprocess.run([sys.executable, "-c", PROBE, str(soft), str(hard)], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, check=True)
    first, again, soft_after = json.loads(done.stdout)
    assert first == again
    return first, soft_after, done.stderr.count("LONGHAUL_GATEWAY_INFLIGHT is 1000"), done.stderr


def test_a_low_soft_limit_is_raised_to_what_the_cap_needs():
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 4096:
        pytest.skip(f"this process's hard limit on open files is {hard}")
    calls, soft_after, warnings, _ = probe(256, 4096)
    assert (calls, soft_after, warnings) == (1000, 2 * 1000 + 64, 0)


def test_a_soft_limit_already_high_enough_is_left_alone():
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 4096:
        pytest.skip(f"this process's hard limit on open files is {hard}")
    assert probe(4096, 4096)[:3] == (1000, 4096, 0)


def test_a_hard_limit_too_low_keeps_fewer_calls_out_and_says_so_once():
    calls, soft_after, warnings, stderr = probe(256, 256)
    assert (calls, soft_after, warnings) == ((256 - 64) // 2, 256, 1)
    assert "keeps 96 out at most" in stderr and "ulimit -n" in stderr
