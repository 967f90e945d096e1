"""The gateways' in-call retries: one task budget, capped backoff, Retry-After honoured, no real sleeping."""

from __future__ import annotations

import random
from datetime import UTC, datetime

import pytest
import time_machine

from tasks.errors import PermanentError, RateLimited, StepTimeout, TransientError
from tasks.gateway.retry import MAX_INLINE_WAIT_S, RetryBudget, backoff_delay, retry_after_seconds, with_retries
from tests.fakes import RecordingSleep

pytestmark = pytest.mark.smoke


def test_a_budget_gives_out_exactly_what_it_has():
    budget = RetryBudget(2)

    assert [budget.take(), budget.take(), budget.take()] == [True, True, False]
    assert budget.used == 2


def test_a_negative_budget_gives_nothing():
    budget = RetryBudget(-3)

    assert budget.take() is False
    assert budget.used == 0


def test_backoff_grows_is_capped_and_jittered(settings):
    settings.LONGHAUL_RETRY_BASE_SECONDS = 1.0
    settings.LONGHAUL_RETRY_CAP_SECONDS = 300.0
    rng = random.Random(7)

    delays = [backoff_delay(attempt, rng=rng) for attempt in range(8)]

    assert 0.5 <= delays[0] <= 1.0
    assert 1.0 <= delays[1] <= 2.0
    assert all(delay <= 10.0 for delay in delays)  # in-call waits stay short whatever the task cap
    assert len(set(delays)) == len(delays)


def test_backoff_never_undercuts_retry_after(settings):
    settings.LONGHAUL_RETRY_BASE_SECONDS = 1.0

    assert backoff_delay(0, retry_after=7.5) == 7.5


def test_retry_after_reads_seconds_and_http_dates():
    assert retry_after_seconds("3") == 3.0
    assert retry_after_seconds(" 1.5 ") == 1.5
    assert retry_after_seconds(None) is None
    assert retry_after_seconds("soon") is None
    assert retry_after_seconds("-4") == 0.0
    with time_machine.travel(datetime(2025, 1, 1, 12, 0, 0, tzinfo=UTC), tick=False):
        assert retry_after_seconds("Wed, 01 Jan 2025 12:00:30 GMT") == 30.0
        assert retry_after_seconds("Wed, 01 Jan 2025 11:00:00 GMT") == 0.0


class Flaky:
    """An attempt that fails with the given errors, then returns "ok"."""

    def __init__(self, *errors: Exception) -> None:
        self.errors = list(errors)
        self.calls = 0

    async def __call__(self) -> str:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return "ok"


async def test_it_retries_transient_errors_within_the_budget():
    attempt = Flaky(TransientError("blip"), StepTimeout("slow"))
    budget, sleep = RetryBudget(5), RecordingSleep()

    assert await with_retries(attempt, budget=budget, sleep=sleep) == "ok"
    assert attempt.calls == 3
    assert budget.used == 2
    assert len(sleep.delays) == 2


async def test_it_raises_the_last_error_when_the_budget_is_spent():
    attempt = Flaky(*[TransientError(f"blip {i}") for i in range(5)])
    budget = RetryBudget(2)

    with pytest.raises(TransientError, match="blip 2"):
        await with_retries(attempt, budget=budget, sleep=RecordingSleep())
    assert attempt.calls == 3
    assert budget.used == 2


async def test_it_never_retries_a_permanent_error():
    attempt = Flaky(PermanentError("no"))
    budget = RetryBudget(5)

    with pytest.raises(PermanentError):
        await with_retries(attempt, budget=budget, sleep=RecordingSleep())
    assert attempt.calls == 1
    assert budget.used == 0


async def test_it_hands_a_long_retry_after_back_to_the_runtime():
    attempt = Flaky(RateLimited("busy", retry_after=MAX_INLINE_WAIT_S + 1))
    budget, sleep = RetryBudget(5), RecordingSleep()

    with pytest.raises(RateLimited) as raised:
        await with_retries(attempt, budget=budget, sleep=sleep)
    assert raised.value.retry_after == MAX_INLINE_WAIT_S + 1
    assert budget.used == 0 and sleep.delays == []
