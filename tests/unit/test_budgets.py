"""Budgets, backoff and request digests: pure logic."""

from __future__ import annotations

import random
from datetime import datetime, timedelta, timezone

import pytest

from tasks.budgets import LIMITS, Budget, backoff_seconds
from tasks.context import digest
from tasks.errors import InvalidInput

pytestmark = pytest.mark.smoke
T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


def test_it_fills_defaults_for_an_empty_budget():
    budget = Budget.parse(None)
    assert budget.max_steps == LIMITS["max_steps"][0]
    assert budget.max_retries == LIMITS["max_retries"][0]


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ({"max_steps": 0}, "budget.max_steps"),
        ({"max_steps": -5}, "budget.max_steps"),
        ({"max_steps": 10**12}, "budget.max_steps"),
        ({"max_retries": "3"}, "budget.max_retries"),
        ({"max_retries": True}, "budget.max_retries"),
        ({"max_wall_seconds": 1.5}, "budget.max_wall_seconds"),
        ({"tokens": 5}, "budget.tokens"),
        ([1, 2], "budget"),
    ],
)
def test_it_names_the_bad_budget_field(raw, field):
    with pytest.raises(InvalidInput) as caught:
        Budget.parse(raw)
    assert caught.value.field == field


def test_it_reports_the_step_budget_as_exhausted():
    budget = Budget.parse({"max_steps": 3})
    assert budget.exhausted(steps_done=2, started_at=T0, now=T0) is None
    assert "step budget of 3" in budget.exhausted(steps_done=3, started_at=T0, now=T0)


def test_it_reports_the_wall_time_budget_as_exhausted():
    budget = Budget.parse({"max_wall_seconds": 60})
    assert budget.exhausted(steps_done=0, started_at=T0, now=T0 + timedelta(seconds=59)) is None
    assert "wall-time" in budget.exhausted(steps_done=0, started_at=T0, now=T0 + timedelta(seconds=60))


def test_backoff_grows_exponentially_within_jitter_bounds():
    rng = random.Random(7)
    for retry in range(6):
        ceiling = min(300.0, 1.0 * 2**retry)
        delay = backoff_seconds(retry, base=1.0, cap=300.0, rng=rng)
        assert ceiling / 2 <= delay <= ceiling


def test_backoff_stops_at_the_cap():
    rng = random.Random(1)
    delays = [backoff_seconds(40, base=1.0, cap=30.0, rng=rng) for _ in range(50)]
    assert max(delays) <= 30.0
    assert min(delays) >= 15.0


def test_backoff_is_jittered():
    rng = random.Random(3)
    assert len({backoff_seconds(4, base=1.0, cap=300.0, rng=rng) for _ in range(10)}) > 1


def test_digest_ignores_key_order_but_not_values():
    assert digest({"a": 1, "b": [1, 2]}) == digest({"b": [1, 2], "a": 1})
    assert digest({"a": 1}) != digest({"a": 2})
    assert len(digest({})) == 64
