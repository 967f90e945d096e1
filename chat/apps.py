from django.apps import AppConfig


class ChatConfig(AppConfig):
    name = "chat"
    verbose_name = "Chat"

    def ready(self) -> None:
        from chat.streams import thread_group_of
        from tasks import events, kicks

        # tasks never imports chat (DESIGN §3): chat tells it, at start, what it needs.
        kicks.register_job("run", "chat.jobs.run_agent")
        events.also_wake(thread_group_of)  # a task's events wake its thread's stream
