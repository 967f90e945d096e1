from django.apps import AppConfig
from django.conf import settings


class ChatConfig(AppConfig):
    name = "chat"
    verbose_name = "Chat"

    def ready(self) -> None:
        from chat.streams import thread_group_of
        from tasks import events, kicks

        # tasks never imports chat (DESIGN §3): chat tells it, at start, what it needs.
        # Chat runs have a queue and workers of their own (`manage.py worker --queue chat`): a burst of
        # messages, each answer up to a model call's timeout, cannot hold the workers task steps need.
        kicks.register_job("run", "chat.jobs.run_agent", queue=settings.LONGHAUL_CHAT_QUEUE)
        events.also_wake(thread_group_of)  # a task's events wake its thread's stream
