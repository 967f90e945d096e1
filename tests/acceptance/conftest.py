from __future__ import annotations

from pathlib import Path

import pytest

from tests.processes import ROOT


@pytest.fixture
def log_dir(request) -> Path:
    """Where child processes write their output; kept for reading after a failure."""
    path = ROOT / "var" / "test-logs" / request.node.name
    path.mkdir(parents=True, exist_ok=True)
    return path
