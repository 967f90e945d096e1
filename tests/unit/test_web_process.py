"""The web process's start-up (project/asgi.py), in an interpreter of its own."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Prints whether the view that serves "/" (imported through the URLconf) is beyond the collector's reach.
PROBE = """
import gc
import project.asgi
from django.urls import resolve
view = resolve("/").func
print(gc.get_freeze_count() > 0, all(obj is not view for obj in gc.get_objects()))
"""


def test_what_start_up_loaded_views_included_is_frozen_out_of_the_collectors_full_passes():
    """A full collection walked all of Django and the apps, holding every socket of the process for
    170-190 ms (bench/stream_latency.py's p99); frozen, it walks only what came after."""
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "project.settings"}
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "True"], out.stderr[-2000:]
