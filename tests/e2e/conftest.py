"""Playwright against a real daphne serving the test database, in Debian's Chromium."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.conf import global_settings

from tests.e2e.chat_page import stop_everything_running, where_tasks_stand
from tests.fakes.mcp_task_server import McpTaskServer, write_servers_file
from tests.processes import ROOT, Process, child_env, daphne

# Playwright's sync API runs an event loop in this thread; the ORM calls the tests
# make around it are still plain synchronous calls.
os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = "true"

SCREENSHOTS = ROOT / "test-results" / "screenshots"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    """A failed e2e test's report says where each unfinished task stood: a flake that shows only in CI is
    then read from its log, not guessed at. Read before teardown cancels what the test left running."""
    outcome = yield
    report = outcome.get_result()
    if report.when == "call" and report.failed:
        try:
            report.sections.append(("where the unfinished tasks stood", where_tasks_stand()))
        except Exception as exc:  # noqa: BLE001 - the report must not hide the failure it reports
            report.sections.append(("where the unfinished tasks stood", f"could not read them: {exc!r}"))


@pytest.fixture(scope="session")
def browser_type_launch_args(browser_type_launch_args: dict[str, Any]) -> dict[str, Any]:
    """Debian's Chromium (browser downloads are impossible here), quiet on the network."""
    return {
        **browser_type_launch_args,
        "executable_path": "/usr/bin/chromium",
        "args": ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run", "--disable-quic"],
    }


@pytest.fixture(scope="session")
def browser_context_args(browser_context_args: dict[str, Any]) -> dict[str, Any]:
    """A common laptop viewport, so desktop screenshots are comparable run to run."""
    return {**browser_context_args, "viewport": {"width": 1280, "height": 800}}


@pytest.fixture(autouse=True)
def _real_password_hashers(settings) -> None:
    """Hash passwords the way the daphne child verifies them (the shared conftest picks a fast test hasher)."""
    settings.PASSWORD_HASHERS = global_settings.PASSWORD_HASHERS


@pytest.fixture(autouse=True)
def _no_channel_layer_here(settings) -> None:
    """This process serves no stream (daphne does, with a layer of its own), so what the tests commit here
    (their set-up, teardown's cancels) has nobody here to wake; and Playwright's event loop in this thread
    would fail every synchronous send, filling a failed test's report with tracebacks."""
    settings.CHANNEL_LAYERS = {}


@pytest.fixture
def cheap_passwords(settings) -> None:
    """For tests that sign in with a session cookie: no password is checked, so hash the cheap way."""
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


@pytest.fixture(scope="session")
def mcp_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The test MCP server over loopback HTTP, configured as server "tools"; yields its state folder."""
    folder = tmp_path_factory.mktemp("mcp")
    state = folder / "state"
    state.mkdir()
    with McpTaskServer(transport="http", state_dir=state) as config:
        os.environ["LONGHAUL_MCP_SERVERS"] = str(write_servers_file(folder / "servers.json", config))
        try:
            yield state
        finally:
            os.environ.pop("LONGHAUL_MCP_SERVERS", None)


@pytest.fixture(scope="session")
def server(django_db_setup: None, mcp_server: Path) -> Iterator[str]:
    """Base URL of a daphne (HTTP and WebSockets) pointed at this session's test database.

    One for the whole session: the database is emptied between tests, and each test signs
    in its own user, so nothing a test leaves in the server's memory meets the next one.
    """
    with daphne(ROOT / "var" / "test-logs" / "e2e") as base:
        yield base


# The worker the tests share: offline research slow enough to watch its phases, debug
# drivers for the test tasks ("run a test task of N steps"), and no step slicing. At 150 ms a model
# call a research task ran for about a second, and a page still loading could miss it running.
WORKER_ENV = {"LONGHAUL_OFFLINE_LATENCY_MS": "400", "LONGHAUL_DEBUG_DRIVERS": "1", "LONGHAUL_STEP_SLICE_MS": "0"}


@pytest.fixture(scope="session")
def worker(django_db_setup: None, mcp_server: Path) -> Iterator[Process]:
    """The real worker commands, as `make run` starts them: task steps, and chat runs on their own queue."""
    logs = ROOT / "var" / "test-logs" / "e2e"
    chat = Process("chat", [sys.executable, "manage.py", "worker", "--queue", "chat"],
                   child_env(LONGHAUL_CHAT_WORKERS="1", **WORKER_ENV), logs)
    proc = Process("worker", [sys.executable, "manage.py", "worker"], child_env(LONGHAUL_WORKERS="2", **WORKER_ENV),
                   logs)
    try:
        yield proc
    finally:
        # Nothing of value is left in them (every test stops what it started), and a cluster
        # can take half a minute to wind down: a short grace, then SIGKILL.
        proc.stop(timeout=3)
        chat.stop(timeout=3)


@pytest.fixture(autouse=True)
def _nothing_left_running(worker: Process) -> Iterator[None]:
    """Stop what a test started before the database is emptied under the worker's feet."""
    yield
    stop_everything_running()


@pytest.fixture(scope="session")
def compiled_catalogs() -> None:
    """The Chinese pages need the compiled catalogs, which `make test` builds (.mo files are not committed)."""
    for domain in ("django", "djangojs"):
        po = ROOT / "locale" / "zh_Hans" / "LC_MESSAGES" / f"{domain}.po"
        mo = po.with_suffix(".mo")
        if not mo.exists() or mo.stat().st_mtime < po.stat().st_mtime:
            pytest.fail(f"{mo.relative_to(ROOT)} is missing or stale: run `make test`, or bin/ensure-gettext and "
                        "`.venv/bin/python manage.py compilemessages --ignore='.*' --ignore=var`")


@pytest.fixture
def screenshots() -> Path:
    """The git-ignored folder the e2e tests save their screenshots in."""
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    return SCREENSHOTS
