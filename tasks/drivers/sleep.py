"""The debug `sleep` driver: steps that sleep, fail or crash on request.

Used by tests, benchmarks and fault drills; enabled only with LONGHAUL_DEBUG_DRIVERS=1.
With `side_effect`, each step performs one effect through the operation ledger,
and the effect inserts a SleepEffect row, so an effect executed twice is visible.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any, ClassVar

from django.db import transaction

from tasks import clock
from tasks.context import StepContext
from tasks.drivers import Ask, Continue, Finish, Outcome, PartialResult, Pins
from tasks.errors import InvalidInput, PermanentError, TransientError
from tasks.models import SleepEffect

FAIL_KINDS = ("transient", "permanent", "crash")
SLEEP_SLICE = 0.05  # seconds between safe points while sleeping


def _int(raw: dict[str, Any], name: str, default: int | None, low: int, high: int) -> int | None:
    value = raw.get(name, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidInput(f"input.{name} must be an integer", field=f"input.{name}")
    if not low <= value <= high:
        raise InvalidInput(f"input.{name} must be between {low} and {high}", field=f"input.{name}")
    return value


class SleepDriver:
    kind: ClassVar[str] = "sleep"
    schema_version: ClassVar[int] = 1
    debug_only: ClassVar[bool] = True

    def pins(self) -> Pins:
        return Pins()

    def validate_input(self, raw: Any, *, tenant: Any = None, internal: bool = False) -> dict[str, Any]:
        if not isinstance(raw, dict):
            raise InvalidInput("input must be an object", field="input")
        known = {"steps", "step_seconds", "fail_at_step", "fail_kind", "fail_times", "side_effect", "ask_at_step",
                 "question"}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise InvalidInput(f"input has unknown fields: {', '.join(unknown)}", field=f"input.{unknown[0]}")
        steps = _int(raw, "steps", 1, 1, 100_000)
        seconds = raw.get("step_seconds", 0)
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 <= seconds <= 60:
            raise InvalidInput("input.step_seconds must be a number between 0 and 60", field="input.step_seconds")
        fail_at = _int(raw, "fail_at_step", None, 1, 100_000)
        fail_kind = raw.get("fail_kind", "transient" if fail_at else None)
        if fail_kind is not None and fail_kind not in FAIL_KINDS:
            raise InvalidInput(f"input.fail_kind must be one of {', '.join(FAIL_KINDS)}", field="input.fail_kind")
        if fail_kind == "crash" and not internal:
            # A crash kills the worker process and every task step in it: a fault drill's tool, never a user's.
            raise InvalidInput("input.fail_kind \"crash\" is only for fault drills run from code, not requests",
                               field="input.fail_kind")
        side_effect = raw.get("side_effect", False)
        if not isinstance(side_effect, bool):
            raise InvalidInput("input.side_effect must be true or false", field="input.side_effect")
        question = raw.get("question", "Should I go on?")
        if not isinstance(question, str) or not 1 <= len(question) <= 1000:
            raise InvalidInput("input.question must be text of 1 to 1000 characters", field="input.question")
        return {
            "ask_at_step": _int(raw, "ask_at_step", None, 1, 100_000),
            "question": question,
            "steps": steps,
            "step_seconds": seconds,
            "fail_at_step": fail_at,
            "fail_kind": fail_kind,
            "fail_times": _int(raw, "fail_times", 1, 1, 1000),
            "side_effect": side_effect,
        }

    def initial_state(self, task_input: dict[str, Any]) -> dict[str, Any]:
        return {"done": 0, "of": task_input["steps"]}

    def step(self, state: dict[str, Any], ctx: StepContext) -> Outcome:
        spec = ctx.input
        number = state["done"] + 1
        if spec.get("ask_at_step") == number and "answer" not in state:
            if not ctx.answer:
                return Ask(state, spec["question"])
            state = {**state, "answer": ctx.answer}
        if spec.get("fail_at_step") == number:
            self._fail(spec, ctx)
        self._sleep(float(spec["step_seconds"]), ctx)
        if spec["side_effect"]:
            ctx.operation(
                "sleep_effect",
                lambda: self._effect(ctx, number),
                args={"step": number},
                side_effect=True,
                verify=lambda: self._effect_done(ctx, number),
            )
        ctx.emit("step_done", step=number, of=state["of"])
        new_state = {**state, "done": number}
        if number >= state["of"]:
            summary = f"Slept through {number} steps."
            if "answer" in state:
                summary += f" You answered: {state['answer']}"
            return Finish(new_state, {"steps": number, "summary": summary})
        return Continue(new_state)

    def partial_result(self, state: dict[str, Any]) -> PartialResult | None:
        if not state.get("done"):
            return None
        return PartialResult({"steps": state["done"]}, f"completed {state['done']} of {state['of']} steps")

    def _fail(self, spec: dict[str, Any], ctx: StepContext) -> None:
        kind = spec["fail_kind"]
        if kind == "crash":
            # What a segfault or an OOM kill looks like to the runtime: the process is just gone.
            os.kill(os.getpid(), signal.SIGKILL)
        if kind == "permanent":
            raise PermanentError(f"step {spec['fail_at_step']} failed permanently, as asked")
        if ctx.retries < spec["fail_times"]:
            raise TransientError(f"step {spec['fail_at_step']} failed transiently, as asked")

    def _sleep(self, seconds: float, ctx: StepContext) -> None:
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            time.sleep(min(SLEEP_SLICE, left))
            ctx.check_safe_point()

    def _effect(self, ctx: StepContext, number: int) -> dict[str, int]:
        with transaction.atomic():
            ctx.fence()  # the effect itself checks the token: a zombie's effect never lands
            SleepEffect.objects.create(task_id=ctx.task.pk, step=number, at=clock.now())
        return {"step": number}

    def _effect_done(self, ctx: StepContext, number: int) -> dict[str, int] | None:
        exists = SleepEffect.objects.filter(task_id=ctx.task.pk, step=number).exists()
        return {"step": number} if exists else None
