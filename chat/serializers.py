"""Public shapes of the chat API: whitelists."""

from __future__ import annotations

from rest_framework import serializers

from chat.models import Message, Run, Thread
from tasks.models import Task
from tasks.serializers import SOME_TEXT, RemoteFactsMixin, StrictCharField
from tasks.statuses import TERMINAL, ErrorClass, NotificationStatus


class ThreadSerializer(serializers.ModelSerializer):
    id = serializers.UUIDField(source="public_id", read_only=True)

    class Meta:
        model = Thread
        fields = ["id", "title", "created_at", "updated_at"]
        read_only_fields = ["id", "created_at", "updated_at"]


class ThreadWriteSerializer(serializers.Serializer):
    title = StrictCharField(max_length=200, required=False, allow_blank=True, default="")


class MessageSerializer(serializers.ModelSerializer):
    run = serializers.SerializerMethodField()
    task = serializers.SerializerMethodField()
    asks = serializers.SerializerMethodField()

    class Meta:
        model = Message
        fields = ["id", "role", "content", "run", "task", "asks", "created_at"]
        read_only_fields = fields

    def get_asks(self, message: Message) -> bool:
        """The message tells of a task's question: the page offers the answer form under it."""
        return (message.data or {}).get("task_status") == "waiting_input"

    def get_run(self, message: Message) -> str | None:
        return str(message.run.public_id) if message.run_id else None

    def get_task(self, message: Message) -> str | None:
        """The task a notification or a start refers to (public id), for linking in the page."""
        data = message.data or {}
        return data.get("task") or data.get("started")


class PostMessageSerializer(serializers.Serializer):
    content = StrictCharField(max_length=8000, trim_whitespace=True, validators=[SOME_TEXT])


class RunSerializer(serializers.ModelSerializer):
    id = serializers.UUIDField(source="public_id", read_only=True)

    class Meta:
        model = Run
        fields = ["id", "kind", "status", "created_at", "started_at", "finished_at"]
        read_only_fields = fields


class PanelTaskSerializer(RemoteFactsMixin, serializers.ModelSerializer):
    """One row of the thread's task panel."""

    id = serializers.UUIDField(source="public_id", read_only=True)
    is_terminal = serializers.SerializerMethodField()
    phase = serializers.SerializerMethodField()
    notification = serializers.SerializerMethodField()
    cancel_requested = serializers.SerializerMethodField()
    # Declared so the schema says "" (no error yet) is a value: a read-only model field loses allow_blank.
    error_class = serializers.ChoiceField(choices=ErrorClass.choices, allow_blank=True, read_only=True)

    class Meta:
        model = Task
        fields = ["id", "name", "kind", "status", "is_terminal", "phase", "question", "error_class", "error_message",
                  "cancel_requested", "tracking_degraded", "result_version", "notification", "created_at",
                  "started_at", "finished_at", "updated_at", "last_event_seq", "question_fields", "remote_error",
                  "cancel_attempts", "cancel_error"]
        read_only_fields = fields

    def get_is_terminal(self, task: Task) -> bool:
        return task.status in TERMINAL

    def get_phase(self, task: Task) -> str:
        return getattr(task, "latest_phase", "") or ""

    def get_cancel_requested(self, task: Task) -> bool:
        return task.cancel_requested_at is not None

    def get_notification(self, task: Task) -> str | None:
        troubled = (NotificationStatus.RETRY, NotificationStatus.DEAD_LETTER)
        return task.notification_status if task.notification_status in troubled else None


# The list endpoints answer an object around the list; these name that envelope for the schema.
class ThreadPageSerializer(serializers.Serializer):
    results = ThreadSerializer(many=True)


class MessagePageSerializer(serializers.Serializer):
    results = MessageSerializer(many=True)
    next_after = serializers.IntegerField()
    busy = serializers.BooleanField()


class PanelPageSerializer(serializers.Serializer):
    results = PanelTaskSerializer(many=True)
    active = serializers.IntegerField()
