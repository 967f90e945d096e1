"""Per-task budgets and the retry backoff they pace."""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings

from tasks.errors import InvalidInput

# name -> (default, minimum, maximum)
LIMITS: dict[str, tuple[int, int, int]] = {
    "max_steps": (1000, 1, 100_000),
    "max_wall_seconds": (6 * 3600, 1, 7 * 24 * 3600),
    "max_retries": (5, 0, 100),
    "queue_deadline_seconds": (24 * 3600, 1, 30 * 24 * 3600),
    "max_model_calls": (200, 1, 100_000),
    "max_tool_calls": (500, 1, 100_000),
    "max_tokens": (2_000_000, 1_000, 1_000_000_000),
}


@dataclass(frozen=True)
class Budget:
    max_steps: int
    max_wall_seconds: int
    max_retries: int
    queue_deadline_seconds: int
    max_model_calls: int
    max_tool_calls: int
    max_tokens: int

    @classmethod
    def parse(cls, raw: Any) -> Budget:
        """A budget from a request body; names the first bad field."""
        if raw is None:
            raw = {}
        if not isinstance(raw, dict):
            raise InvalidInput("budget must be an object", field="budget")
        unknown = sorted(set(raw) - set(LIMITS))
        if unknown:
            raise InvalidInput(f"budget has unknown fields: {', '.join(unknown)}", field=f"budget.{unknown[0]}")
        values = {}
        for name, (default, low, high) in LIMITS.items():
            value = raw.get(name, default)
            if isinstance(value, bool) or not isinstance(value, int):
                raise InvalidInput(f"budget.{name} must be an integer", field=f"budget.{name}")
            if not low <= value <= high:
                raise InvalidInput(f"budget.{name} must be between {low} and {high}", field=f"budget.{name}")
            values[name] = value
        return cls(**values)

    @classmethod
    def of(cls, task_budget: dict[str, Any]) -> Budget:
        """The stored budget of a task (already validated), with defaults for missing names."""
        return cls(**{name: int(task_budget.get(name, default)) for name, (default, _, _) in LIMITS.items()})

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    def queue_deadline(self, now: datetime) -> datetime:
        """When a task queued now stops waiting for a slot (at submission, resume or requeue)."""
        return now + timedelta(seconds=self.queue_deadline_seconds)

    def exhausted(self, *, steps_done: int, started_at: datetime | None, now: datetime) -> str | None:
        """Which budget is used up before the next step, if any."""
        if steps_done >= self.max_steps:
            return f"step budget of {self.max_steps} used"
        if started_at and (now - started_at).total_seconds() >= self.max_wall_seconds:
            return f"wall-time budget of {self.max_wall_seconds} s used"
        return None


def backoff_seconds(retry: int, *, base: float | None = None, cap: float | None = None,
                    rng: random.Random | None = None) -> float:
    """Exponential backoff with a cap and equal jitter: half fixed, half random."""
    base = settings.LONGHAUL_RETRY_BASE_SECONDS if base is None else base
    cap = settings.LONGHAUL_RETRY_CAP_SECONDS if cap is None else cap
    ceiling = min(cap, base * 2 ** min(retry, 16))
    return ceiling / 2 + (rng or random).uniform(0, ceiling / 2)


def retry_at(now: datetime, retry: int, *, hint: float | None = None) -> datetime:
    """When a retry may run: the backoff, or the server's Retry-After if that is later."""
    delay = backoff_seconds(retry)
    if hint is not None:
        delay = max(delay, hint)
    return now + timedelta(seconds=delay)
