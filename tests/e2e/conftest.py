"""Playwright against a real daphne serving the test database, in Debian's Chromium."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.conf import global_settings

from tests.processes import ROOT, daphne

# Playwright's sync API runs an event loop in this thread; the ORM calls the tests
# make around it are still plain synchronous calls.
os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = "true"

SCREENSHOTS = ROOT / "test-results" / "screenshots"


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


@pytest.fixture(scope="module")
def server(django_db_setup: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Base URL of a daphne (HTTP and WebSockets) pointed at this session's test database."""
    with daphne(tmp_path_factory.mktemp("daphne")) as base:
        yield base


@pytest.fixture
def screenshots() -> Path:
    """The git-ignored folder the e2e tests save their screenshots in."""
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    return SCREENSHOTS
