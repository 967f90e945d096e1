"""Short in-call retries that draw on the task's one retry budget (DESIGN §4, Retries and budgets)."""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Awaitable, Callable
from email.utils import parsedate_to_datetime
from typing import TypeVar

from django.conf import settings

from tasks import clock
from tasks.budgets import backoff_seconds
from tasks.errors import RateLimited, StepError, StepTimeout, TransientError

T = TypeVar("T")
Sleep = Callable[[float], Awaitable[None]]

# A gateway call waits in place only briefly: longer waits hold a concurrency slot
# for nothing, so they are handed back to the runtime, which schedules a retry_wait.
INLINE_BACKOFF_CAP_S = 10.0
MAX_INLINE_WAIT_S = 30.0


class RetryBudget:
    """Retries a call may still draw from its task's one retry budget."""

    def __init__(self, remaining: int) -> None:
        self.remaining = max(0, remaining)
        self.used = 0

    def take(self) -> bool:
        """Draw one retry; False when none is left."""
        if self.used >= self.remaining:
            return False
        self.used += 1
        return True

    def __repr__(self) -> str:
        return f"RetryBudget(remaining={self.remaining - self.used}, used={self.used})"


def backoff_delay(attempt: int, *, retry_after: float | None = None, rng: random.Random | None = None) -> float:
    """Seconds to wait before retry number `attempt` (0-based); never less than the server's Retry-After."""
    cap = min(settings.LONGHAUL_RETRY_CAP_SECONDS, INLINE_BACKOFF_CAP_S)
    delay = backoff_seconds(attempt, cap=cap, rng=rng)
    if retry_after is not None:
        delay = max(delay, retry_after)
    return delay


def retry_after_seconds(value: str | None) -> float | None:
    """A Retry-After header in seconds, whether given as a number or as an HTTP date."""
    if not value:
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        pass
    else:
        return max(0.0, seconds) if math.isfinite(seconds) else None  # "inf" says nothing usable
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        return None
    return max(0.0, (when - clock.now()).total_seconds())


async def with_retries(
    attempt: Callable[[], Awaitable[T]],
    *,
    budget: RetryBudget,
    sleep: Sleep = asyncio.sleep,
    retry_on: tuple[type[StepError], ...] = (TransientError, RateLimited, StepTimeout),
    max_inline_wait: float = MAX_INLINE_WAIT_S,
) -> T:
    """Run `attempt` until it succeeds, retrying the given error classes while the budget lasts.

    A Retry-After longer than `max_inline_wait` is raised rather than slept: a provider's calls pass 0,
    so that its 429 pauses its whole pool (tasks/pools.py) instead of each call waiting on its own."""
    retries = 0
    while True:
        try:
            return await attempt()
        except retry_on as exc:
            retry_after = getattr(exc, "retry_after", None)
            if retry_after is not None and retry_after > max_inline_wait:
                raise
            if not budget.take():
                raise
            await sleep(backoff_delay(retries, retry_after=retry_after))
            retries += 1
