"""The one clock. Read it once per operation and pass the value down; tests move it with time-machine."""

from __future__ import annotations

from datetime import datetime

from django.utils import timezone


def now() -> datetime:
    return timezone.now()
