"""Public shapes of the task API. Whitelists: a field not named here never leaves the server."""

from __future__ import annotations

from typing import Any

from django.core.validators import RegexValidator
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from tasks.budgets import LIMITS
from tasks.models import Task, TaskEvent
from tasks.statuses import TERMINAL, ErrorClass


class StrictCharField(serializers.CharField):
    """A string field that refuses numbers and booleans, which DRF would quietly turn into "5" or "True"."""

    def to_internal_value(self, data: Any) -> str:
        if not isinstance(data, str):
            self.fail("invalid")
        return super().to_internal_value(data)


class StrictBooleanField(serializers.BooleanField):
    """true or false only: DRF also takes "yes", "0", 1 and the like, which the schema does not offer."""

    def to_internal_value(self, data: Any) -> bool:
        if not isinstance(data, bool):
            self.fail("invalid", input=data)
        return data


class StrictIntegerField(serializers.IntegerField):
    """A JSON integer only: DRF also takes "5", 5.0 and true."""

    def to_internal_value(self, data: Any) -> int:
        if isinstance(data, bool) or not isinstance(data, int):
            self.fail("invalid")
        return super().to_internal_value(data)


# Text that must say something: DRF trims whitespace, so "  " is as empty as "".
# "Not only whitespace", spelled out as the characters Python's str.strip() removes: `\S` means
# something else in the schema's (ECMAScript) regexes, so a client checking the schema and this
# server would disagree about "\x85" or "\ufeff".
PYTHON_WHITESPACE = r"\t\n\x0b\x0c\r\x1c-\x1f \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
SOME_TEXT = RegexValidator(f"[^{PYTHON_WHITESPACE}]", message="must contain some text")


@extend_schema_field({
    "type": "object",
    "nullable": True,
    "additionalProperties": False,
    "properties": {name: {"type": "integer", "minimum": low, "maximum": high, "default": default}
                   for name, (default, low, high) in LIMITS.items()},
    "description": "Limits for this task; a name left out takes its default. Checked by tasks.budgets.Budget.",
})
class BudgetField(serializers.JSONField):
    """A task budget; validated by Budget.parse, which names the bad field."""


class TaskSerializer(serializers.ModelSerializer):
    id = serializers.UUIDField(source="public_id", read_only=True)
    thread = serializers.SerializerMethodField()
    cancel_requested = serializers.SerializerMethodField()
    pause_requested = serializers.SerializerMethodField()
    is_terminal = serializers.SerializerMethodField()
    # Declared so the schema says "" (no error yet) is a value: a read-only model field loses allow_blank.
    error_class = serializers.ChoiceField(choices=ErrorClass.choices, allow_blank=True, read_only=True)

    class Meta:
        model = Task
        fields = [
            "id", "kind", "name", "status", "priority", "thread", "input", "budget", "question",
            "error_class", "error_message", "current_step", "waiting_reason", "tracking_degraded", "retries",
            "cancel_requested", "pause_requested", "is_terminal", "result_version", "last_event_seq",
            "created_at", "started_at", "finished_at", "updated_at",
        ]
        read_only_fields = fields

    def get_thread(self, task: Task) -> str | None:
        return str(task.thread.public_id) if task.thread_id else None

    def get_cancel_requested(self, task: Task) -> bool:
        return task.cancel_requested_at is not None

    def get_pause_requested(self, task: Task) -> bool:
        return task.pause_requested_at is not None

    def get_is_terminal(self, task: Task) -> bool:
        return task.status in TERMINAL


class EventSerializer(serializers.ModelSerializer):
    class Meta:
        model = TaskEvent
        fields = ["seq", "kind", "status", "at", "data"]
        read_only_fields = fields


class EventPageSerializer(serializers.Serializer):
    results = EventSerializer(many=True)
    next_after = serializers.IntegerField()


class ResultSerializer(serializers.Serializer):
    id = serializers.UUIDField()
    status = serializers.CharField()
    result = serializers.JSONField()
    result_version = serializers.IntegerField()


class SubmitSerializer(serializers.Serializer):
    # The schema lists the kinds this deployment runs (project.openapi); the driver registry checks them.
    kind = StrictCharField(max_length=32)
    name = StrictCharField(max_length=200, required=False, allow_blank=True, default="")
    input = serializers.JSONField(required=False, default=dict)
    budget = BudgetField(required=False, allow_null=True, default=None)
    priority = StrictIntegerField(required=False, default=0, min_value=-10, max_value=10)
    thread = serializers.UUIDField(required=False, allow_null=True, default=None)

    def validate_input(self, value: Any) -> Any:
        if not isinstance(value, dict):
            raise serializers.ValidationError("must be an object")
        return value


class CancelSerializer(serializers.Serializer):
    reason = StrictCharField(max_length=500, required=False, allow_blank=True, default="")
    keep_results = StrictBooleanField(required=False, default=False)


class PauseSerializer(serializers.Serializer):
    reason = StrictCharField(max_length=500, required=False, allow_blank=True, default="")


class AnswerSerializer(serializers.Serializer):
    answer = StrictCharField(max_length=10_000, validators=[SOME_TEXT])


class ResumeSerializer(serializers.Serializer):
    budget = BudgetField(required=False, allow_null=True, default=None)


class ErrorSerializer(serializers.Serializer):
    error = serializers.CharField()
    code = serializers.CharField()
    field = serializers.CharField(required=False)
