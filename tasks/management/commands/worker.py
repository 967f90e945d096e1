"""`manage.py worker [--queue chat]`: a django-q2 cluster, supervised (tasks/supervisor.py)."""

from __future__ import annotations

import os
import sys
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django_q.conf import Conf

from tasks import scheduling, supervisor


def cluster_name(queue: str) -> str:
    return settings.LONGHAUL_CHAT_QUEUE if queue == "chat" else settings.Q_CLUSTER["name"]


class Command(BaseCommand):
    help = ("Run a django-q2 cluster: task steps, calls and sweeps (the default), or chat runs (--queue chat). "
            "When a dead process may have wedged it, replace the whole cluster, restarting this process in "
            "place (same pid).")

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--queue", choices=("tasks", "chat"), default="tasks",
                            help="the queue this cluster serves (default tasks); run one of each")
        parser.add_argument("--stall-seconds", type=float, default=supervisor.STALL_SECONDS,
                            help="replace the cluster when due work waits this long while every worker is idle "
                                 f"(default {supervisor.STALL_SECONDS:g})")

    def handle(self, *args: Any, queue: str, stall_seconds: float, **options: Any) -> None:
        if not stall_seconds > 0:
            raise CommandError("--stall-seconds must be above 0")
        wanted = cluster_name(queue)
        if Conf.CLUSTER_NAME != wanted:
            # django-q2 reads its cluster's name from Q_CLUSTER_NAME once, at import: start again with it set.
            env = {**os.environ, "Q_CLUSTER_NAME": wanted}
            os.execve(sys.executable, sys.orig_argv, env)
        if queue == "tasks":
            scheduling.admit_at_start()  # a raised LONGHAUL_MAX_RUNNING frees slots that no transition fills
        if supervisor.run_cluster(stall_seconds=stall_seconds):
            supervisor.restart_in_place()
