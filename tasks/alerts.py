"""Raise operator alerts from the runtime, inside the caller's transaction."""

from __future__ import annotations

import logging
from datetime import datetime

from django.conf import settings
from django.core.mail import mail_admins
from django.db import transaction

from tasks.models import Alert, Task

log = logging.getLogger(__name__)


def raise_alert(kind: str, message: str, *, now: datetime, task: Task | None = None, tenant_id: int | None = None) -> Alert:
    alert = Alert.objects.create(kind=kind, message=message, created_at=now, task=task,
                                 tenant_id=tenant_id if tenant_id is not None else (task.tenant_id if task else None))
    # The message quotes task names and error text, which can carry user input; it is in the Alert row
    # for the admin, and only ids go to the log at WARNING.
    log.warning("alert %s raised: alert %s, task %s, tenant %s", kind, alert.pk, task.pk if task else None,
                alert.tenant_id)
    log.debug("alert %s message: %s", alert.pk, message)
    if getattr(settings, "LONGHAUL_ALERT_EMAIL", False):
        transaction.on_commit(lambda: mail_admins(f"Longhaul alert: {kind}", message, fail_silently=True))
    return alert
