from django.apps import AppConfig


class WebhooksConfig(AppConfig):
    name = "webhooks"
    verbose_name = "Webhooks"

    def ready(self) -> None:
        from tasks import events, kicks
        from webhooks import outbox
        from webhooks.models import EVENT_TYPES

        # tasks never imports webhooks (DESIGN §3): webhooks tells it, at start, what it needs.
        kicks.register_job("webhook", "webhooks.jobs.deliver")
        events.on_append(outbox.on_events, kinds=EVENT_TYPES)
