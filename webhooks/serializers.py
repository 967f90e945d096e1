"""Public shapes of the webhooks API. Whitelists: the secret appears only in the answer that made it."""

from __future__ import annotations

from django.core.validators import RegexValidator
from rest_framework import serializers

from tasks.serializers import StrictBooleanField, StrictCharField, shown
from webhooks.endpoints import ALL_EVENTS
from webhooks.models import Delivery, Endpoint


class EndpointSerializer(serializers.ModelSerializer):
    id = serializers.UUIDField(source="public_id", read_only=True)
    events = serializers.ListField(child=serializers.CharField(), read_only=True)
    scope = serializers.SerializerMethodField()

    class Meta:
        model = Endpoint
        fields = ("id", "url", "events", "description", "enabled", "scope", "created_at", "secret_rotated_at",
                  "previous_secret_expires_at")
        read_only_fields = fields

    def get_scope(self, endpoint: Endpoint) -> str:
        """"tenant": every task of the tenant; "own": only the tasks of the user who registered it."""
        return "tenant" if endpoint.owner_id is None else "own"


class EndpointWithSecretSerializer(EndpointSerializer):
    secret = serializers.SerializerMethodField()

    class Meta(EndpointSerializer.Meta):
        fields = (*EndpointSerializer.Meta.fields, "secret")
        read_only_fields = fields

    def get_secret(self, endpoint: Endpoint) -> str:
        """Shown once: store it now, it is never shown again."""
        return self.context["secret"]


# The network rules (no private or loopback addresses...) are checked by webhooks.destinations.
HTTP_URL = RegexValidator(r"^https?://", message="must be an http or https URL")


class RegisterSerializer(serializers.Serializer):
    url = StrictCharField(max_length=2000, validators=[HTTP_URL],
                          help_text="Where deliveries are POSTed: http(s), not a private or loopback address.")
    events = serializers.ListField(child=serializers.ChoiceField(choices=ALL_EVENTS), min_length=1,
                                   max_length=len(ALL_EVENTS))
    description = StrictCharField(max_length=200, required=False, allow_blank=True, default="")
    enabled = StrictBooleanField(required=False, default=True)


class ChangeSerializer(serializers.Serializer):
    events = serializers.ListField(child=serializers.ChoiceField(choices=ALL_EVENTS), min_length=1,
                                   max_length=len(ALL_EVENTS), required=False)
    description = StrictCharField(max_length=200, required=False, allow_blank=True)
    enabled = StrictBooleanField(required=False)


class DeliverySerializer(serializers.ModelSerializer):
    task = serializers.UUIDField(source="task.public_id", read_only=True)
    version = serializers.IntegerField(source="event_seq", read_only=True)
    last_error = serializers.SerializerMethodField()

    class Meta:
        model = Delivery
        fields = ("webhook_id", "event_type", "task", "version", "status", "attempts", "next_attempt_at",
                  "last_status_code", "last_error", "created_at", "delivered_at")
        read_only_fields = fields

    def get_last_error(self, delivery: Delivery) -> str:
        return shown(delivery.last_error)
