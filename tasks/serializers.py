"""Public shapes of the task API. Whitelists: a field not named here never leaves the server."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from django.core.validators import RegexValidator
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from tasks.budgets import LIMITS
from tasks.mcp import forms
from tasks.models import Task, TaskEvent
from tasks.statuses import TERMINAL, ErrorClass

if TYPE_CHECKING:
    from tasks.mcp.config import Server

SHOWN_ERROR_CHARS = 500  # errors kept in full (<= 4,000) are shown this long
# Event data keys that name a remote task's handle: internal, never sent.
HANDLE_KEYS = frozenset({"handle", "remote", "remote_handle", "task_id"})


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


def shown(text: str) -> str:
    """An error as the API shows it: at most SHOWN_ERROR_CHARS characters, an ellipsis marking a cut."""
    return text if len(text) <= SHOWN_ERROR_CHARS else text[:SHOWN_ERROR_CHARS - 1] + "…"


def server_title(name: str) -> str | None:
    """A configured MCP server's display name; None for a server no longer configured."""
    from tasks.mcp import config  # the MCP client (and its SDK) loads only where a remote task is shown

    server = config.servers().get(name)
    return display_name(server) if server is not None else None


def display_name(server: Server) -> str:
    """What people call a server: its configured `title` (tasks.mcp.config defaults it to the name)."""
    return server.title


def public_input(task: Task) -> dict[str, Any]:
    """A task's input as its owner may see it: an mcp task names its server by display name only."""
    if task.kind != "mcp" or not isinstance(task.input, dict):
        return task.input
    shown_input = {k: v for k, v in task.input.items() if k != "server"}
    if title := server_title(str(task.input.get("server", ""))):
        shown_input["server"] = title
    return shown_input


def public_event_data(data: Any) -> Any:
    """An event's data without remote handles, naming an MCP server by display name only."""
    if not isinstance(data, dict):
        return data
    public = {k: v for k, v in data.items() if k not in HANDLE_KEYS and k != "server"}
    if "server" in data and (title := server_title(str(data["server"]))):
        public["server"] = title
    return public


def question_fields(task: Task) -> list[dict[str, Any]]:
    """The fields of the form the task's question asks to fill; [] for a free-text question."""
    try:
        return [f.as_dict() for f in forms.fields(task.question_form)]
    except forms.Unsupported:
        return []  # the driver never asks with such a form; an old row answers as text


@extend_schema_field({
    "type": "array",
    "items": {"type": "object", "properties": {
        "name": {"type": "string"}, "title": {"type": "string"}, "description": {"type": "string"},
        "type": {"type": "string", "enum": ["text", "number", "integer", "boolean", "choice"]},
        "required": {"type": "boolean"}, "choices": {"type": "array", "items": {"type": "string"}},
        "choice_titles": {"type": "array", "items": {"type": "string"}},
        "minimum": {"type": "number", "nullable": True}, "maximum": {"type": "number", "nullable": True},
        "max_length": {"type": "integer", "nullable": True}, "min_length": {"type": "integer", "nullable": True}}},
    "description": "The form the question asks to fill, in order; [] for a question answered with text.",
})
class QuestionFieldsField(serializers.SerializerMethodField):
    """The question's form (tasks.mcp.forms.Field.as_dict), for the schema."""


class RemoteFactsMixin(serializers.Serializer):
    """What a remote task's polls and cancels last said, bounded for display."""

    remote_error = serializers.SerializerMethodField()
    cancel_attempts = serializers.IntegerField(source="remote_cancel_attempts", read_only=True)
    cancel_error = serializers.SerializerMethodField()
    question_fields = QuestionFieldsField()

    def get_remote_error(self, task: Task) -> str:
        return shown(task.remote_poll_error)

    def get_cancel_error(self, task: Task) -> str:
        return shown(task.remote_cancel_error)

    def get_question_fields(self, task: Task) -> list[dict[str, Any]]:
        return question_fields(task)


class NotificationSerializer(serializers.Serializer):
    status = serializers.CharField(source="notification_status")
    attempts = serializers.IntegerField(source="notification_attempt_count")
    last_error = serializers.SerializerMethodField()

    def get_last_error(self, task: Task) -> str:
        return shown(task.notification_error)


class TaskSerializer(RemoteFactsMixin, serializers.ModelSerializer):
    id = serializers.UUIDField(source="public_id", read_only=True)
    thread = serializers.SerializerMethodField()
    input = serializers.SerializerMethodField()
    notification = NotificationSerializer(source="*", read_only=True)
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
            "created_at", "started_at", "finished_at", "updated_at", "question_fields", "remote_error",
            "cancel_attempts", "cancel_error", "notification", "model_name", "prompt_version",
        ]
        read_only_fields = fields

    def get_input(self, task: Task) -> dict[str, Any]:
        return public_input(task)

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

    def to_representation(self, event: Any) -> dict[str, Any]:
        shape = super().to_representation(event)
        shape["data"] = public_event_data(shape["data"])
        return shape


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


MAX_ANSWER_CHARS = 10_000


@extend_schema_field({
    "oneOf": [
        {"type": "string", "minLength": 1, "maxLength": MAX_ANSWER_CHARS,
         "description": "Free text, for a question without a form or with a single text field."},
        {"type": "object", "required": ["action"], "additionalProperties": False, "properties": {
            "action": {"type": "string", "enum": list(forms.ACTIONS)},
            "content": {"type": "object", "description": "Field values by name (accept only)."}},
         "description": f"At most {MAX_ANSWER_CHARS} characters as JSON."},
    ],
})
class AnswerField(serializers.Field):
    """Text, or {"action": "accept", "content": {...}} / {"action": "decline"} / {"action": "cancel"}.
    The shape is checked here; the values against the question's form by tasks.actions.answer."""

    def to_internal_value(self, data: Any) -> str | dict[str, Any]:
        if isinstance(data, str):
            text = data.strip()
            if not text:
                raise serializers.ValidationError("must contain some text")
            if len(data) > MAX_ANSWER_CHARS:
                raise serializers.ValidationError(f"must be at most {MAX_ANSWER_CHARS} characters")
            return text
        if isinstance(data, dict) and data.get("action") in forms.ACTIONS:
            # As bounded as a text answer: the answer is stored, and sent to the server, whole.
            if len(json.dumps(data, ensure_ascii=False, separators=(",", ":"))) > MAX_ANSWER_CHARS:
                raise serializers.ValidationError(f"must be at most {MAX_ANSWER_CHARS} characters as JSON")
            return data
        raise serializers.ValidationError('must be text or an object with an action ("accept", "decline", "cancel")')

    def to_representation(self, value: Any) -> Any:
        return value


class AnswerSerializer(serializers.Serializer):
    answer = AnswerField()


class ResumeSerializer(serializers.Serializer):
    budget = BudgetField(required=False, allow_null=True, default=None)


class ErrorSerializer(serializers.Serializer):
    error = serializers.CharField()
    code = serializers.CharField()
    field = serializers.CharField(required=False)
