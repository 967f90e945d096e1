from django.apps import AppConfig


class TasksConfig(AppConfig):
    name = "tasks"
    verbose_name = "Background tasks"

    def ready(self) -> None:
        from django_q.signals import post_spawn

        from tasks import checks  # noqa: F401  (registers the system checks)
        from tasks.drain import install_in_worker

        post_spawn.connect(install_in_worker, dispatch_uid="longhaul-drain")
