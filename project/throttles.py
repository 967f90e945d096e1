"""Request throttling: per-user and per-tenant limits on the writes that make work.

Each kind of write (task submissions, answers, chat messages, new threads) has two limits, one for the
user and one for their tenant, read from the settings LONGHAUL_THROTTLE_<KIND>_<USER|TENANT> at request
time. A view names its kind with `throttle_classes = (SubmitThrottle,)` and the like; only its POST counts.
DRF checks throttles after authentication and before the handler, so a refused request writes nothing.
It is answered 429 `throttled` in the one error shape, with a message naming the limit and Retry-After.

The counts are DRF's SimpleRateThrottle histories in the default cache: Redis when REDIS_URL is set,
shared by every daphne (project/settings.py). Like DRF's, a count is read, then written: two processes
at the same instant may both pass the last free slot, so a limit can be exceeded by a request or two.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from django.conf import settings
from redis.exceptions import RedisError
from rest_framework import exceptions
from rest_framework.request import Request
from rest_framework.throttling import BaseThrottle, SimpleRateThrottle

from tasks import clock
from tasks.tenancy import TENANT_HEADER, tenant_for

logger = logging.getLogger(__name__)

Per = Literal["user", "tenant"]
PERIODS = {1: "a second", 60: "a minute", 3600: "an hour", 86400: "a day"}


@dataclass(frozen=True)
class Action:
    """A kind of write that is throttled; `name` picks its settings."""

    name: str
    singular: str
    plural: str

    def rate(self, per: Per) -> tuple[int, int] | None:
        return getattr(settings, f"LONGHAUL_THROTTLE_{self.name.upper()}_{per.upper()}")


def _clock_seconds() -> float:
    return clock.now().timestamp()


class Limit(SimpleRateThrottle):
    """One action's rate, counted per user or per tenant."""

    timer = staticmethod(_clock_seconds)

    def __init__(self, action: Action, per: Per) -> None:
        self.action = action
        self.per = per
        self.scope = f"{action.name}_{per}"
        self.key: str | None = None
        super().__init__()

    def get_rate(self) -> Any:
        return self.action.rate(self.per)

    def parse_rate(self, rate: Any) -> tuple[int | None, int | None]:
        # Parsed (and validated, naming the variable) when the settings load: project.env.parse_rate.
        return rate if rate is not None else (None, None)

    def get_cache_key(self, request: Request, view: Any) -> str | None:
        if self.per == "user":
            ident = request.user.pk
        else:
            tenant = tenant_for(request.user, slug=request.META.get(TENANT_HEADER))
            # No tenant: the view answers 403 no_tenant and writes nothing, so there is nothing to count.
            ident = tenant.pk if tenant else None
        return None if ident is None else self.cache_format % {"scope": self.scope, "ident": ident}

    def throttle_success(self) -> bool:
        # Not counted yet: WriteThrottle records the request once every limit has let it through, so a
        # refused request counts against none (one user over their own limit spends no tenant allowance).
        return True

    def record(self) -> None:
        if self.rate is not None and self.key is not None:
            super().throttle_success()

    def retry_after(self) -> int:
        """Whole seconds until one more request fits, at least 1: until the window has dropped enough of
        the counted requests (the history is newest first)."""
        assert self.num_requests is not None and self.duration is not None
        leaving = self.history[self.num_requests - 1]
        return max(1, math.ceil(leaving + self.duration - self.now))

    def describe(self) -> str:
        assert self.num_requests is not None and self.duration is not None
        noun = self.action.singular if self.num_requests == 1 else self.action.plural
        period = PERIODS.get(self.duration, f"per {self.duration} seconds")
        return f"at most {self.num_requests} {noun} {period} per {self.per}"


class RateLimitExceeded(exceptions.Throttled):
    """A 429 that names the limit and when to retry (DRF's own says only "Request was throttled")."""

    def __init__(self, limit: Limit) -> None:
        seconds = limit.retry_after()
        unit = "second" if seconds == 1 else "seconds"
        super().__init__(detail=f"{limit.describe()}; try again in {seconds} {unit}")
        self.wait = seconds  # project.api_errors sends it as Retry-After


class WriteThrottle(BaseThrottle):
    """The user's and the tenant's limit on one action, for POST requests."""

    action: ClassVar[Action]

    def allow_request(self, request: Request, view: Any) -> bool:
        if request.method != "POST" or not request.user.is_authenticated:
            return True
        limits = [Limit(self.action, "user"), Limit(self.action, "tenant")]
        try:
            refused = [limit for limit in limits if not limit.allow_request(request, view)]
            if refused:
                # Raised rather than returned: DRF would build its own message, without the limit's.
                raise RateLimitExceeded(max(refused, key=Limit.retry_after))
            for limit in limits:
                limit.record()
        except RedisError as exc:
            # A guard, not a gate: while the cache is unreachable, writes go on unthrottled.
            logger.warning("throttle %s not checked, the cache is unreachable: %s", self.action.name, exc)
        return True


class SubmitThrottle(WriteThrottle):
    action = Action("submit", "task submission", "task submissions")


class AnswerThrottle(WriteThrottle):
    action = Action("answer", "answer", "answers")


class MessageThrottle(WriteThrottle):
    action = Action("message", "message", "messages")


class ThreadThrottle(WriteThrottle):
    action = Action("thread", "new thread", "new threads")
