"""The admission record of each submission (AdmissionRecord), written where its decisions happen and in
their transactions: arrival (transitions.enqueue_new) or refusal (scheduling.record_rejection), first
admission (scheduling.admit), first claim (transitions.claim, or on PostgreSQL the one-statement claim of
tasks/leases.py), first slot release and end (transitions._move). tasks/replay.py replays them.

One row per submission, updated in place: a task re-admitted after a pause, an answer or an operator's
requeue keeps its first admission and first release (the replay replays first admissions only); its
end is its last one.
"""

from __future__ import annotations

from datetime import datetime

from django.db import connection
from django.db.models import DateTimeField, Value
from django.db.models.functions import Coalesce

from tasks import prepared
from tasks.admission_policy import SystemPolicy, TenantPolicy, system_policy
from tasks.budgets import Budget
from tasks.models import AdmissionRecord, Task, Tenant


def _policy(tenant: TenantPolicy, system: SystemPolicy) -> dict[str, int | float]:
    return {"weight": tenant.weight, "max_running": tenant.max_running, "max_queued": tenant.max_queued,
            "system_max_running": system.max_running, "system_max_queued": system.max_queued,
            "aging_seconds": system.aging_seconds, "shed_threshold": system.shed_threshold}


def _new(task: Task, tenant: TenantPolicy, system: SystemPolicy, **fields: object) -> AdmissionRecord:
    return AdmissionRecord.objects.create(
        task_id=task.pk, tenant_id=task.tenant_id, priority=task.priority, kind=task.kind,
        max_wall_seconds=Budget.of(task.budget).max_wall_seconds, arrived_at=task.created_at,
        **_policy(tenant, system), **fields)


def arrived(task: Task) -> None:
    """A task was accepted into its tenant's queue, under the quotas of the tenant it was submitted with;
    it waits from its created_at, as admission measures."""
    quotas = task.tenant
    _new(task, TenantPolicy(quotas.weight, quotas.max_running, quotas.max_queued), system_policy())


def refused(tenant: Tenant, *, priority: int, kind: str, max_wall_seconds: int, rule: str,
            tenant_policy: TenantPolicy, system: SystemPolicy, now: datetime) -> None:
    """A submission was refused before any task existed: `rule` names the limit."""
    AdmissionRecord.objects.create(tenant=tenant, priority=priority, kind=kind, max_wall_seconds=max_wall_seconds,
                                   arrived_at=now, refused=True, rule=rule[:32], **_policy(tenant_policy, system))


def admitted(task: Task, *, tenant: TenantPolicy, system: SystemPolicy, now: datetime) -> None:
    """The task got a slot. Only its first admission is kept, with the policy it was chosen under."""
    first = AdmissionRecord.objects.filter(task_id=task.pk, admitted_at__isnull=True)
    if first.update(admitted_at=now, **_policy(tenant, system)):
        return
    if not AdmissionRecord.objects.filter(task_id=task.pk).exists():
        # A task with no arrival on record (written before records were kept, or staged by hand):
        # its admission is still worth keeping.
        _new(task, tenant, system, admitted_at=now)


def started(task: Task, *, now: datetime) -> None:
    """A worker claimed the task's first step."""
    AdmissionRecord.objects.filter(task_id=task.pk, started_at__isnull=True).update(started_at=now)


def released(task: Task, *, slot: bool, ended: bool, now: datetime) -> None:
    """The task gave its slot back (`slot`: the first release is kept) and/or ended (its last end is kept)."""
    if not (slot or ended):
        return
    if connection.vendor == "postgresql":  # at every task's end: written out and prepared (see _RELEASED)
        params = [now] * slot + [now, str(task.status)] * ended + [task.pk]
        prepared.execute(_RELEASED[slot, ended], params)
        return
    fields: dict[str, object] = {}
    if slot:
        fields["slot_released_at"] = Coalesce("slot_released_at", Value(now, output_field=DateTimeField()))
    if ended:
        fields.update(finished_at=now, outcome=task.status)
    AdmissionRecord.objects.filter(task_id=task.pk).update(**fields)


def _released_sql(*, slot: bool, ended: bool) -> str:
    sets = (['"slot_released_at" = COALESCE("slot_released_at", %s)'] * slot
            + ['"finished_at" = %s', '"outcome" = %s'] * ended)
    return f'UPDATE "{AdmissionRecord._meta.db_table}" SET {", ".join(sets)} WHERE "task_id" = %s'


# released's UPDATE, written out: compiled by the ORM it cost 0.5 ms of CPU at every task's end, prepared 0.1 ms.
_RELEASED = {(slot, ended): _released_sql(slot=slot, ended=ended)
             for slot, ended in ((True, True), (True, False), (False, True))}

