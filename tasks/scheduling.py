"""Admission: which queued task gets a running slot, and when submissions are refused.

Quotas: a tenant holds at most `max_running` slots and keeps at most `max_queued`
tasks waiting; the system caps both too (LONGHAUL_MAX_RUNNING, LONGHAUL_MAX_QUEUED).
"""

from __future__ import annotations

from datetime import datetime

from django.conf import settings
from django.db import connection, transaction

from tasks import kicks, transitions
from tasks.errors import QuotaExceeded
from tasks.models import Task, Tenant
from tasks.statuses import HOLDS_SLOT, TaskStatus

QUEUE_FULL_RETRY_AFTER = 30  # seconds a refused client is asked to wait


def check_queue_capacity(tenant: Tenant) -> None:
    """Refuse a submission up front (429) rather than time it out later."""
    queued = Task.objects.filter(tenant=tenant, status=TaskStatus.QUEUED).count()
    if queued >= tenant.max_queued:
        raise QuotaExceeded(
            f"tenant {tenant.slug} already has {queued} queued tasks (limit {tenant.max_queued})",
            retry_after=QUEUE_FULL_RETRY_AFTER,
        )
    if Task.objects.filter(status=TaskStatus.QUEUED).count() >= settings.LONGHAUL_MAX_QUEUED:
        raise QuotaExceeded("the system queue is full", retry_after=QUEUE_FULL_RETRY_AFTER)


def admit(tenant_id: int, *, now: datetime) -> list[int]:
    """Admit as many of the tenant's queued tasks as its free slots allow; kick each."""
    assert connection.in_atomic_block
    # The tenant row lock serializes admissions of one tenant, so two admitters
    # cannot both take its last slot.
    tenant = Tenant.objects.select_for_update().get(pk=tenant_id)
    running = Task.objects.filter(tenant_id=tenant_id, status__in=HOLDS_SLOT).count()
    free = tenant.max_running - running
    if free <= 0:
        return []
    system_free = settings.LONGHAUL_MAX_RUNNING - Task.objects.filter(status__in=HOLDS_SLOT).count()
    free = min(free, system_free)
    if free <= 0:
        return []
    candidates = list(
        Task.objects.filter(tenant_id=tenant_id, status=TaskStatus.QUEUED).order_by("-priority", "created_at")[:free]
    )
    admitted = []
    for task in candidates:
        if transitions.admit(task, now=now):
            kicks.kick("advance", task.pk)
            admitted.append(task.pk)
    return admitted


def admit_waiting_tenants(*, now: datetime) -> int:
    """The sweeper's safety net: admission for every tenant with queued tasks."""
    tenant_ids = Task.objects.filter(status=TaskStatus.QUEUED).values_list("tenant_id", flat=True).distinct()
    count = 0
    for tenant_id in list(tenant_ids):
        with transaction.atomic():
            count += len(admit(tenant_id, now=now))
    return count
