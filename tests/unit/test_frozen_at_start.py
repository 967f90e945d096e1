"""What a process loads at start-up is frozen out of the collector's full passes (gc.freeze), each
checked in a fresh interpreter: the web process (project/asgi.py) and the worker cluster's main
process, which its workers fork from (tasks/supervisor.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Prints whether the view that serves "/" (imported through the URLconf) is beyond the collector's reach.
WEB_PROBE = """
import gc
import project.asgi
from django.urls import resolve
view = resolve("/").func
print(gc.get_freeze_count() > 0, all(obj is not view for obj in gc.get_objects()))
"""

# Prints whether what a worker's jobs run (the step job, the gateway's HTTP client, a driver) is beyond the
# collector's reach once the cluster's main process has frozen what its workers share.
WORKER_PROBE = """
import gc
import django
django.setup()
from tasks import supervisor
supervisor.freeze_what_workers_share()
import aiohttp
import httpx2
from tasks.drivers.research import ResearchDriver
from tasks.gateway.transport import AiohttpTransport
from tasks.jobs import advance
shared = (advance, httpx2.AsyncClient, aiohttp.ClientSession, AiohttpTransport, ResearchDriver)
print(gc.get_freeze_count() > 0, all(obj is not o for obj in gc.get_objects() for o in shared))
"""


def _probe(code: str) -> list[str]:
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "project.settings"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    return out.stdout.split() or [out.stderr[-2000:]]


def test_what_the_web_process_loaded_views_included_is_frozen_out_of_the_collectors_full_passes():
    """A full collection walked all of Django and the apps, holding every socket of the process for
    170-190 ms (bench/stream_latency.py's p99); frozen, it walks only what came after."""
    assert _probe(WEB_PROBE) == ["True", "True"]


def test_what_the_workers_run_is_frozen_before_they_fork():
    """A gateway job holding 200 calls paused 130-225 ms in each full collection, walking Django, the apps
    and httpx2 again; the workers fork from the cluster's main process, so what it froze stays frozen."""
    assert _probe(WORKER_PROBE) == ["True", "True"]
