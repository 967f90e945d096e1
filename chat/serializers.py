"""Public shapes of the chat API: whitelists."""

from __future__ import annotations

from typing import Any

from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from chat.models import Message, Proposal, Run, Thread
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


class ProposalSerializer(serializers.ModelSerializer):
    """A side effect the model proposed, as its card shows it: a server by its display name, never its
    configured name; a task by its name."""

    id = serializers.UUIDField(source="public_id", read_only=True)
    server = serializers.SerializerMethodField()
    tool = serializers.SerializerMethodField()
    arguments = serializers.SerializerMethodField()
    name = serializers.SerializerMethodField()

    class Meta:
        model = Proposal
        fields = ["id", "action", "status", "name", "server", "tool", "arguments", "outcome", "created_at",
                  "decided_at"]
        read_only_fields = fields

    def get_name(self, proposal: Proposal) -> str:
        """The task it would start, or the task it would cancel."""
        return str(proposal.arguments.get("name", ""))

    def get_server(self, proposal: Proposal) -> str | None:
        if proposal.action != Proposal.Action.START_REMOTE_TOOL:
            return None
        return str(proposal.arguments.get("server_title", ""))

    def get_tool(self, proposal: Proposal) -> str | None:
        if proposal.action != Proposal.Action.START_REMOTE_TOOL:
            return None
        return str(proposal.arguments.get("tool", ""))

    @extend_schema_field({"type": "object", "nullable": True, "additionalProperties": True})
    def get_arguments(self, proposal: Proposal) -> dict[str, Any] | None:
        if proposal.action != Proposal.Action.START_REMOTE_TOOL:
            return None
        return proposal.arguments.get("arguments") or {}


class DecisionSerializer(serializers.Serializer):
    decision = serializers.ChoiceField(choices=["confirm", "decline"])


class MessageSerializer(serializers.ModelSerializer):
    """context["proposals"] (public id -> Proposal) saves a query per card; without it each is read."""

    id = serializers.IntegerField(source="seq", read_only=True,
                                  help_text="The message's number in its thread, from 1: the `after` cursor.")
    run = serializers.SerializerMethodField()
    task = serializers.SerializerMethodField()
    asks = serializers.SerializerMethodField()
    proposal = serializers.SerializerMethodField()
    decides = serializers.SerializerMethodField()

    class Meta:
        model = Message
        fields = ["id", "role", "content", "run", "task", "asks", "proposal", "decides", "created_at"]
        read_only_fields = fields

    @extend_schema_field(ProposalSerializer(allow_null=True))
    def get_proposal(self, message: Message) -> dict[str, Any] | None:
        """The message is the card of this proposal: the page draws it with Confirm and Decline."""
        return self._proposal(message, "proposal")

    @extend_schema_field(ProposalSerializer(allow_null=True))
    def get_decides(self, message: Message) -> dict[str, Any] | None:
        """The message tells how this proposal was decided: the page redraws its card."""
        return self._proposal(message, "decides")

    def _proposal(self, message: Message, key: str) -> dict[str, Any] | None:
        public_id = (message.data or {}).get(key)
        if not public_id:
            return None
        known = self.context.get("proposals")
        if known is not None:
            row = known.get(str(public_id))
        else:
            row = Proposal.objects.filter(thread_id=message.thread_id, public_id=public_id).first()
        return ProposalSerializer(row).data if row is not None else None

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
