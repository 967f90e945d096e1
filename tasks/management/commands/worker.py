"""`manage.py worker`: the django-q2 cluster, supervised (tasks/supervisor.py)."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from tasks import supervisor


class Command(BaseCommand):
    help = ("Run the django-q2 cluster (task steps, sweeps). When a dead process may have wedged it, "
            "replace the whole cluster, restarting this process in place (same pid).")

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--stall-seconds", type=float, default=supervisor.STALL_SECONDS,
                            help="replace the cluster when due work waits this long while every worker is idle "
                                 f"(default {supervisor.STALL_SECONDS:g})")

    def handle(self, *args: Any, stall_seconds: float, **options: Any) -> None:
        if not stall_seconds > 0:
            raise CommandError("--stall-seconds must be above 0")
        if supervisor.run_cluster(stall_seconds=stall_seconds):
            supervisor.restart_in_place()
