"""Safe defaults: a deployment that sets nothing runs without DEBUG and without the debug task kinds, and
nobody outside the process can ask a worker to crash."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest
from django.utils import timezone

from chat.models import Run, Thread
from chat.tools import start_background_task
from project import master_keys
from tasks.models import Task
from tests.factories import submit_sleep

ROOT = Path(__file__).resolve().parents[2]
# What a process needs from the machine; nothing the test session or a developer's shell has set
# (DEBUG, DJANGO_ALLOW_ASYNC_UNSAFE, ...) may reach the process whose defaults are tested.
MACHINE_VARIABLES = ("PATH", "HOME", "LANG", "TMPDIR")


def deployment_env(tmp_path: Path, **variables: str) -> dict[str, str]:
    """The environment of a process started with only `variables` set, as an operator would start it."""
    env = {k: v for k, v in os.environ.items() if k in MACHINE_VARIABLES}
    env.update(DJANGO_SETTINGS_MODULE="project.settings", LONGHAUL_VAR_DIR=str(tmp_path), **variables)
    return env


def production_keys() -> dict[str, str]:
    """What a deployment must set: the secret key and the master keys (neither is generated without DEBUG)."""
    return {"SECRET_KEY": secrets.token_urlsafe(50), "LONGHAUL_MASTER_KEYS": master_keys.generate("k1")}


def settings_of(env: dict[str, str]) -> dict[str, object]:
    script = ("import django, json; django.setup(); from django.conf import settings as s; "
              "from tasks.drivers import available_kinds; "
              "print(json.dumps({'DEBUG': s.DEBUG, 'LONGHAUL_DEBUG_DRIVERS': s.LONGHAUL_DEBUG_DRIVERS, "
              "'SESSION_COOKIE_SECURE': s.SESSION_COOKIE_SECURE, 'CSRF_COOKIE_SECURE': s.CSRF_COOKIE_SECURE, "
              "'kinds': available_kinds()}))")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, check=False,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_deployment_that_sets_nothing_runs_without_debug_or_debug_kinds(tmp_path):
    shown = settings_of(deployment_env(tmp_path, **production_keys()))
    assert shown["DEBUG"] is False
    assert shown["LONGHAUL_DEBUG_DRIVERS"] is False
    assert shown["SESSION_COOKIE_SECURE"] is True and shown["CSRF_COOKIE_SECURE"] is True
    assert "sleep" not in shown["kinds"]


def test_debug_alone_does_not_turn_on_the_debug_kinds(tmp_path):
    shown = settings_of(deployment_env(tmp_path, DEBUG="1"))
    assert shown["DEBUG"] is True
    assert shown["LONGHAUL_DEBUG_DRIVERS"] is False
    assert "sleep" not in shown["kinds"]
    assert "sleep" in settings_of(deployment_env(tmp_path, DEBUG="1", LONGHAUL_DEBUG_DRIVERS="1"))["kinds"]


def test_the_deployment_check_passes_with_production_settings(tmp_path):
    env = deployment_env(tmp_path, **production_keys(), ALLOWED_HOSTS="longhaul.example.com",
                         SECURE_SSL_REDIRECT="1", SECURE_HSTS_SECONDS="31536000",
                         SECURE_HSTS_INCLUDE_SUBDOMAINS="1", SECURE_HSTS_PRELOAD="1",
                         LONGHAUL_TLS_PROXY_HEADER="X-Forwarded-Proto")
    done = subprocess.run([sys.executable, "manage.py", "check", "--deploy", "--fail-level", "WARNING"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "no issues" in done.stdout


def test_a_proxy_header_that_is_not_a_header_name_stops_the_process_naming_the_variable(tmp_path):
    env = deployment_env(tmp_path, DEBUG="1", LONGHAUL_TLS_PROXY_HEADER="X-Forwarded-Proto: https")
    done = subprocess.run([sys.executable, "-c", "import django; django.setup()"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode != 0
    assert "LONGHAUL_TLS_PROXY_HEADER" in done.stderr


CRASH = {"steps": 2, "fail_at_step": 1, "fail_kind": "crash"}


@pytest.mark.django_db
def test_the_api_refuses_the_crash_fault_even_with_the_debug_kinds_on(alice_api):
    response = alice_api.post("/api/tasks", {"kind": "sleep", "input": CRASH}, format="json")
    assert response.status_code == 400, response.content
    assert response.json()["field"] == "input.fail_kind"
    assert "crash" in response.json()["error"]
    assert not Task.objects.exists()
    # The other faults stay available to drills run over the API.
    ok = alice_api.post("/api/tasks", {"kind": "sleep", "input": {**CRASH, "fail_kind": "transient"}}, format="json")
    assert ok.status_code == 201, ok.content


@pytest.mark.django_db
def test_a_model_cannot_start_a_crashing_task_either(acme, alice):
    thread = Thread.objects.create(tenant=acme, owner=alice, title="t")
    run = Run.objects.create(thread=thread, tenant=acme, created_at=timezone.now())
    reply = start_background_task(run, kind="sleep", name="doomed", input=CRASH)
    assert reply.data == {"error": True}
    assert "crash" in reply.text
    assert not Task.objects.exists()


@pytest.mark.django_db
def test_code_in_the_process_may_still_drill_a_crash(acme, alice):
    task = submit_sleep(acme, alice, **CRASH)
    assert task.input["fail_kind"] == "crash"


@pytest.mark.parametrize(("variables", "named"), [
    ({"LONGHAUL_RETENTION_EVENTS_DAYS": "-1"}, "LONGHAUL_RETENTION_EVENTS_DAYS must be at least 0"),
    ({"LONGHAUL_RETENTION_AUDIT_DAYS": "30"}, "LONGHAUL_RETENTION_AUDIT_DAYS must be 0 or at least"),
])
def test_a_retention_that_breaks_the_rules_stops_the_process_naming_the_variable(tmp_path, variables, named):
    env = deployment_env(tmp_path, **production_keys(), **variables)
    done = subprocess.run([sys.executable, "-c", "import django; django.setup()"], cwd=ROOT, env=env,
                          capture_output=True, text=True, check=False, timeout=60)
    assert done.returncode != 0
    assert named in done.stderr
