"""What a driver's step may use: its input, safe points, events, the outcomes of the calls the
previous step requested, and the ledger of database-local effects."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from typing import Any

from django.db import transaction

from tasks import clock, leases, sealed
from tasks.budgets import Budget
from tasks.errors import CancelRequested, LeaseLost, PauseRequested, PermanentError, StepError
from tasks.events import NewEvent
from tasks.heartbeat import heartbeat
from tasks.models import Operation, Task
from tasks.statuses import OperationStatus

SAFE_POINT_CHECK_INTERVAL = 0.2  # seconds between database reads of the cancel and pause flags


def digest(value: Any) -> str:
    """sha256 of a value's canonical JSON."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, separators=(",", ":"), default=str).encode()).hexdigest()


class StepContext:
    def __init__(self, task: Task, *, token: int, checked: bool = False, outcomes: list[Any] | None = None) -> None:
        """`checked`: `task` was read (or fenced) just now, which counts as the first safe point's read.
        `outcomes`: the previous step's outcomes, when the runner has just read them (else read when asked)."""
        self.task = task
        self._outcomes = outcomes
        self.token = token
        self.step = task.current_step  # 0-based index of the step being run
        self.events: list[NewEvent] = []
        self._next_operation = 0
        self._checked_at = time.monotonic() if checked else 0.0

    @property
    def input(self) -> dict[str, Any]:
        return self.task.input

    @property
    def budget(self) -> Budget:
        return Budget.of(self.task.budget)

    @property
    def answer(self) -> str:
        """The owner's answer to the task's last question ("" when none)."""
        return self.task.answer

    @property
    def answer_data(self) -> dict[str, Any] | None:
        """The owner's structured answer to the task's last question (None when they answered in text or not at all)."""
        return self.task.answer_data

    @property
    def retries(self) -> int:
        return self.task.retries

    def requested_outcomes(self) -> list[Any]:
        """Outcomes of the calls (model, tool, MCP) the previous step requested, in request order."""
        from tasks.operations import outcomes

        if self._outcomes is None:
            self._outcomes = outcomes(self.task.pk, self.step - 1) if self.step > 0 else []
        return self._outcomes

    def emit(self, kind: str, **data: Any) -> None:
        """An event committed with this step's checkpoint."""
        self.events.append(NewEvent(kind, data))

    def check_safe_point(self, *, force: bool = False) -> None:
        """Stop here if the lease is gone or the user asked to cancel or pause."""
        if heartbeat.lost(self.task.pk):
            raise LeaseLost(f"task {self.task.pk}: heartbeat lost the lease")
        if not force and time.monotonic() - self._checked_at < SAFE_POINT_CHECK_INTERVAL:
            return
        self._checked_at = time.monotonic()
        row = (
            Task.objects.filter(pk=self.task.pk)
            .values("fencing_token", "cancel_requested_at", "pause_requested_at")
            .first()
        )
        if row is None or row["fencing_token"] != self.token:
            raise LeaseLost(f"task {self.task.pk}: fencing token {self.token} is stale")
        if row["cancel_requested_at"] is not None:
            raise CancelRequested()
        if row["pause_requested_at"] is not None:
            raise PauseRequested()

    def fence(self) -> None:
        """Inside a transaction: lock the task row and prove this step still holds it."""
        leases.lock_fenced(self.task.pk, self.token)

    def operation(
        self,
        name: str,
        run: Callable[[], Any],
        *,
        args: Any = None,
        side_effect: bool = False,
        verify: Callable[[], Any | None] | None = None,
    ) -> Any:
        """Run one database-local effect at most once per task step (a network call is never one:
        a step requests it with Continue(requests=...) and a gateway job runs it).

        Its key (task, step, n) is the same on every attempt. A finished operation's
        result is reused, never re-executed. A side-effecting operation found started
        by an attempt that died is first checked with `verify`, which returns the
        effect's result if it happened.
        """
        n = self._next_operation
        self._next_operation += 1
        key = f"{self.task.pk}:{self.step}:{n}"
        args_digest = digest(args)
        existing = Operation.objects.filter(key=key).first()
        if existing is not None:
            if existing.args_digest != args_digest or existing.name != name:
                raise PermanentError("the step asked for a different operation on replay",
                                     detail=f"{key}: {existing.name} -> {name}")
            if existing.status == OperationStatus.SUCCEEDED:
                return existing.result
            if existing.status == OperationStatus.STARTED and side_effect and verify is not None:
                found = verify()
                if found is not None:
                    self._record(key, OperationStatus.SUCCEEDED, result=found)
                    return found
        self.check_safe_point(force=True)
        now = clock.now()
        with transaction.atomic():
            self.fence()
            if existing is None:
                Operation.objects.create(
                    task_id=self.task.pk, key=key, step=self.step, n=n, kind="effect", name=name,
                    mode=Operation.Mode.LOCAL, args_digest=args_digest, has_side_effects=side_effect,
                    fencing_token=self.token, started_at=now,
                )
            else:
                Operation.objects.filter(key=key).update(
                    status=OperationStatus.STARTED, attempts=existing.attempts + 1, fencing_token=self.token,
                    started_at=now, finished_at=None, error_class="", error_message="",
                )
        try:
            result = run()
        except StepError as exc:
            self._record(key, OperationStatus.FAILED, error=exc)
            raise
        self._record(key, OperationStatus.SUCCEEDED, result=result)
        self.check_safe_point()
        return result

    def _record(self, key: str, status: str, *, result: Any = None, error: StepError | None = None) -> None:
        with transaction.atomic():
            self.fence()
            Operation.objects.filter(key=key).update(
                status=status, result=sealed.Sealed(self.task.tenant_id, result) if result is not None else None,
                finished_at=clock.now(),
                error_class=error.error_class if error else "", error_message=str(error) if error else "",
            )
