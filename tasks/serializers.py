"""Public shapes of the task API. Whitelists: a field not named here never leaves the server."""

from __future__ import annotations

from typing import Any

from rest_framework import serializers

from tasks.models import Task, TaskEvent
from tasks.statuses import TERMINAL


class TaskSerializer(serializers.ModelSerializer):
    id = serializers.UUIDField(source="public_id", read_only=True)
    thread = serializers.SerializerMethodField()
    cancel_requested = serializers.SerializerMethodField()
    pause_requested = serializers.SerializerMethodField()
    is_terminal = serializers.SerializerMethodField()

    class Meta:
        model = Task
        fields = [
            "id", "kind", "name", "status", "priority", "thread", "input", "budget", "question",
            "error_class", "error_message", "current_step", "waiting_reason", "retries",
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
    kind = serializers.CharField(max_length=32)
    name = serializers.CharField(max_length=200, required=False, allow_blank=True, default="")
    input = serializers.JSONField(required=False, default=dict)
    budget = serializers.JSONField(required=False, default=None)
    priority = serializers.IntegerField(required=False, default=0, min_value=-10, max_value=10)
    thread = serializers.UUIDField(required=False, allow_null=True, default=None)

    def validate_input(self, value: Any) -> Any:
        if not isinstance(value, dict):
            raise serializers.ValidationError("must be an object")
        return value


class CancelSerializer(serializers.Serializer):
    reason = serializers.CharField(max_length=500, required=False, allow_blank=True, default="")
    keep_results = serializers.BooleanField(required=False, default=False)


class PauseSerializer(serializers.Serializer):
    reason = serializers.CharField(max_length=500, required=False, allow_blank=True, default="")


class AnswerSerializer(serializers.Serializer):
    answer = serializers.CharField(max_length=10_000)


class ResumeSerializer(serializers.Serializer):
    budget = serializers.JSONField(required=False, default=None)


class ErrorSerializer(serializers.Serializer):
    error = serializers.CharField()
    code = serializers.CharField()
    field = serializers.CharField(required=False)
