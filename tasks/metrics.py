"""Prometheus metrics, computed from the database at scrape time (DESIGN §11).

The truth lives in the tables, shared by every web and worker process, so one
custom collector reads it on each scrape instead of keeping process-local counters.
Every query is bounded: a GROUP BY over a partial index (queued, slot-holding,
leased, in-flight rows), or a recent window (WINDOW) capped at SAMPLE rows.
Windowed figures are gauges that go down as the window slides: read them as they
are, not with rate(). Latency distributions are gauge histograms over the sample.
Parked tasks, dead letters, refusals and the event windows are bounded only once
their partial indexes exist (event_metrics_idx, task_parked_idx, task_dead_letter_idx,
audit_rejected_idx, proposed with this module); until then those queries scan.

Not exported: notification delivery latency. The outbox on the task row records
neither when an event version was noted nor when it was delivered, so only terminal
events could be approximated (task.finished_at to the notification run's finish);
it waits for those two timestamps rather than exporting a figure that misleads.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from datetime import datetime, timedelta
from typing import NamedTuple

from django.conf import settings
from django.db.models import Count, Min, Q, Sum
from django.db.models.fields.json import KT
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeHistogramMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tasks import clock, operations, pools, scheduling
from tasks.models import Alert, AuditEntry, Operation, Pool, RetentionMark, Task, TaskEvent, Tenant
from tasks.statuses import HOLDS_SLOT, NotificationStatus, OperationStatus, TaskStatus

WINDOW = timedelta(hours=1)
SAMPLE = 2000  # newest admissions / finished operations a latency distribution is computed from
DEFAULT_LONG_WAIT_SECONDS = 300.0
# Not terminal and not queued or slot-holding: parked until someone acts.
PARKED = (TaskStatus.WAITING_INPUT, TaskStatus.PAUSED, TaskStatus.PARTIAL)
WAIT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600)
CALL_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_SLOT_STATUSES = sorted(HOLDS_SLOT)


def long_wait_seconds() -> float:
    """A queued task waiting longer than this counts as 'not scheduled for long'."""
    return float(getattr(settings, "LONGHAUL_METRICS_LONG_WAIT_SECONDS", DEFAULT_LONG_WAIT_SECONDS))


class TenantRow(NamedTuple):
    slug: str
    max_running: int
    max_queued: int
    weight: int


Tenants = dict[int, TenantRow]


class DatabaseCollector(Collector):
    """Reads the runtime's tables on every scrape."""

    def collect(self) -> Iterator[Metric]:
        now = clock.now()
        tenants = {pk: TenantRow(*row) for pk, *row in
                   Tenant.objects.values_list("pk", "slug", "max_running", "max_queued", "weight")}
        yield from task_metrics(tenants, now=now)
        yield from admission_metrics(tenants, now=now)
        yield from recovery_metrics(tenants, now=now)
        yield from pool_metrics(now=now)


REGISTRY = CollectorRegistry(auto_describe=False)
REGISTRY.register(DatabaseCollector())


def render(*, tenants: frozenset[str] | None = None) -> bytes:
    """The Prometheus text exposition of every Longhaul metric; with `tenants`, only those tenants'
    series, beside the system-wide figures (which name no tenant)."""
    if tenants is None:
        return generate_latest(REGISTRY)
    scoped = CollectorRegistry(auto_describe=False)
    scoped.register(ScopedCollector(tenants))
    return generate_latest(scoped)


class ScopedCollector(DatabaseCollector):
    """What a staff member scoped to some tenants may see: series labelled with another tenant are left out."""

    def __init__(self, tenants: frozenset[str]) -> None:
        self.tenants = tenants

    def collect(self) -> Iterator[Metric]:
        for metric in super().collect():
            metric.samples = [s for s in metric.samples if s.labels.get("tenant", "") in self.tenants
                              or "tenant" not in s.labels]
            yield metric


def _slug(tenants: Tenants, tenant_id: int | None) -> str:
    row = tenants.get(tenant_id) if tenant_id is not None else None
    return row.slug if row else str(tenant_id)


# --- tasks, slots and queues ------------------------------------------------------


def task_metrics(tenants: Tenants, *, now: datetime) -> Iterator[Metric]:
    """Tasks by status and tenant, slots and quotas, and why queued tasks are still queued."""
    by_status = GaugeMetricFamily("longhaul_tasks", "Tasks that are not finished, by tenant and status.",
                                  labels=["tenant", "status"])
    queued = _count_by_tenant(Task.objects.filter(status=TaskStatus.QUEUED))  # task_queued_idx
    held = _count_by(Task.objects.filter(status__in=_SLOT_STATUSES), "tenant_id", "status")  # task_slot_idx
    parked = _count_by(Task.objects.filter(status__in=PARKED), "tenant_id", "status")
    for tenant_id, n in queued.items():
        by_status.add_metric([_slug(tenants, tenant_id), TaskStatus.QUEUED], n)
    for (tenant_id, status), n in {**held, **parked}.items():
        by_status.add_metric([_slug(tenants, tenant_id), status], n)
    yield by_status

    running: dict[int, int] = defaultdict(int)
    for (tenant_id, _status), n in held.items():
        running[tenant_id] += n
    yield from _quota_metrics(tenants, running)
    yield from _queue_metrics(tenants, queued, running, now=now)


def _quota_metrics(tenants: Tenants, running: dict[int, int]) -> Iterator[Metric]:
    families = {
        "max_running": GaugeMetricFamily("longhaul_tenant_max_running", "Running slots a tenant may hold.",
                                         labels=["tenant"]),
        "max_queued": GaugeMetricFamily("longhaul_tenant_max_queued", "Tasks a tenant may keep queued.",
                                        labels=["tenant"]),
        "weight": GaugeMetricFamily("longhaul_tenant_weight", "A tenant's weight in the share of running slots.",
                                    labels=["tenant"]),
    }
    for row in tenants.values():
        for name, value in (("max_running", row.max_running), ("max_queued", row.max_queued),
                            ("weight", row.weight)):
            families[name].add_metric([row.slug], value)
    yield from families.values()
    yield GaugeMetricFamily("longhaul_system_running", "Tasks holding a running slot, system-wide.",
                            value=sum(running.values()))
    yield GaugeMetricFamily("longhaul_system_max_running", "The system's cap on running slots.",
                            value=settings.LONGHAUL_MAX_RUNNING)
    yield GaugeMetricFamily("longhaul_system_max_queued", "The system's cap on queued tasks.",
                            value=settings.LONGHAUL_MAX_QUEUED)


def _queue_metrics(tenants: Tenants, queued: dict[int, int], running: dict[int, int], *,
                   now: datetime) -> Iterator[Metric]:
    threshold = long_wait_seconds()
    oldest = dict(Task.objects.filter(status=TaskStatus.QUEUED).order_by().values("tenant_id")
                  .annotate(first=Min("created_at")).values_list("tenant_id", "first"))
    long_waits = _count_by_tenant(Task.objects.filter(status=TaskStatus.QUEUED,
                                                      created_at__lt=now - timedelta(seconds=threshold)))
    oldest_family = GaugeMetricFamily("longhaul_queue_oldest_wait_seconds",
                                      "How long the oldest queued task of a tenant has waited.", labels=["tenant"])
    long_family = GaugeMetricFamily("longhaul_queue_waiting_long",
                                    "Queued tasks that have waited longer than "
                                    "longhaul_queue_waiting_long_threshold_seconds.", labels=["tenant"])
    for tenant_id, first in oldest.items():
        oldest_family.add_metric([_slug(tenants, tenant_id)], max(0.0, (now - first).total_seconds()))
        long_family.add_metric([_slug(tenants, tenant_id)], long_waits.get(tenant_id, 0))
    yield oldest_family
    yield long_family
    yield GaugeMetricFamily("longhaul_queue_waiting_long_threshold_seconds",
                            "The wait after which a queued task counts in longhaul_queue_waiting_long.",
                            value=threshold)
    yield _delay_reasons(tenants, queued, running)


def _delay_reasons(tenants: Tenants, queued: dict[int, int], running: dict[int, int]) -> Metric:
    """Why queued tasks are not running: their tenant's cap, the system's cap, or neither
    (admission is overdue: the sweeper will fill the slot)."""
    family = GaugeMetricFamily("longhaul_queue_delay_reason",
                               "Queued tasks by why they wait: tenant_cap, system_cap, or admission_due.",
                               labels=["tenant", "reason"])
    system_full = sum(running.values()) >= settings.LONGHAUL_MAX_RUNNING
    for tenant_id, n in queued.items():
        cap = tenants[tenant_id].max_running if tenant_id in tenants else 0
        if running.get(tenant_id, 0) >= cap:
            reason = "tenant_cap"
        elif system_full:
            reason = "system_cap"
        else:
            reason = "admission_due"
        family.add_metric([_slug(tenants, tenant_id), reason], n)
    return family


# --- admission waits and refusals -------------------------------------------------


def admission_metrics(tenants: Tenants, *, now: datetime) -> Iterator[Metric]:
    """How long admitted tasks waited in the queue, and how many submissions were refused."""
    waits = GaugeHistogramMetricFamily(
        "longhaul_admission_wait_seconds",
        f"Queue wait of the newest admissions (at most {SAMPLE}, within {int(WINDOW.total_seconds())} s), by tenant.",
        labels=["tenant"])
    for tenant_id, seconds in sorted(admission_waits(now=now).items()):
        waits.add_metric([_slug(tenants, tenant_id)], _buckets(seconds, WAIT_BUCKETS), sum(seconds))
    yield waits

    refused = GaugeMetricFamily("longhaul_queue_rejections_recent",
                                f"Submissions refused with 429 in the last {int(WINDOW.total_seconds())} s, by the "
                                f"rule that refused them (tenant_queue_full, system_queue_full, shed_low_priority).",
                                labels=["tenant", "rule"])
    rows = AuditEntry.objects.filter(action=scheduling.REJECTED, at__gte=now - WINDOW)
    for (tenant_id, rule), n in _count_by(rows, "tenant_id", rule=KT("details__rule")).items():
        refused.add_metric([_slug(tenants, tenant_id), rule or "queue_full"], n)
    yield refused


def admission_waits(*, now: datetime) -> dict[int, list[float]]:
    """Seconds each recent admission waited, by tenant id.

    A wait runs from the first of the contiguous 'queued'-status events just before
    the 'admitted' one (submission, resume or answer) to the admission. Event seqs
    are gapless per task, so contiguity is a matter of consecutive seqs.
    """
    admitted = list(
        TaskEvent.objects.filter(kind="admitted", at__gte=now - WINDOW)
        .order_by("-at").values_list("task_id", "tenant_id", "seq", "at")[:SAMPLE]
    )
    queued_at = {
        (task_id, seq): at
        for task_id, seq, at in TaskEvent.objects.filter(
            task_id__in={row[0] for row in admitted}, status=TaskStatus.QUEUED
        ).values_list("task_id", "seq", "at")
    }
    waits: dict[int, list[float]] = defaultdict(list)
    for task_id, tenant_id, seq, at in admitted:
        entered, before = None, seq - 1
        while (task_id, before) in queued_at:
            entered, before = queued_at[(task_id, before)], before - 1
        if entered is not None:
            waits[tenant_id].append(max(0.0, (at - entered).total_seconds()))
    return waits


# --- leases, retries, dead letters ------------------------------------------------


def recovery_metrics(tenants: Tenants, *, now: datetime) -> Iterator[Metric]:
    """Leases that expired, takeovers, retries by error class, dead-lettered notifications."""
    since = now - WINDOW
    window = int(WINDOW.total_seconds())
    expired = GaugeMetricFamily("longhaul_leases_expired",
                                "Tasks whose worker stopped renewing its lease and nobody has taken over yet.",
                                labels=["tenant"])
    rows = Task.objects.exclude(lease_owner="").filter(lease_expires_at__lt=now)  # task_leased_idx
    for tenant_id, n in _count_by_tenant(rows).items():
        expired.add_metric([_slug(tenants, tenant_id)], n)
    yield expired

    takeovers = GaugeMetricFamily("longhaul_lease_takeovers_recent",
                                  f"Tasks taken over from a worker whose lease expired, in the last {window} s.",
                                  labels=["tenant"])
    for tenant_id, n in _count_by_tenant(TaskEvent.objects.filter(kind="recovered", at__gte=since)).items():
        takeovers.add_metric([_slug(tenants, tenant_id)], n)
    yield takeovers

    retries = GaugeMetricFamily("longhaul_retries_recent",
                                f"Step retries scheduled in the last {window} s, by error class.",
                                labels=["tenant", "error_class"])
    rows = TaskEvent.objects.filter(kind="retry_scheduled", at__gte=since)
    for (tenant_id, error_class), n in _count_by(rows, "tenant_id", error_class=KT("data__error_class")).items():
        retries.add_metric([_slug(tenants, tenant_id), error_class or "unknown"], n)
    yield retries

    dead = GaugeMetricFamily("longhaul_notification_dead_letters",
                             "Tasks whose notification was dead-lettered and not yet retried.", labels=["tenant"])
    rows = Task.objects.filter(notification_status=NotificationStatus.DEAD_LETTER)
    for tenant_id, n in _count_by_tenant(rows).items():
        dead.add_metric([_slug(tenants, tenant_id)], n)
    yield dead

    yield liveness_repairs()
    yield retention_purged()


def retention_purged() -> Metric:
    """Rows the retention purge deleted (or emptied: operation payloads, results), by data class."""
    purged = CounterMetricFamily("longhaul_retention_purged",
                                 "Rows purged by retention (tasks/retention.py), by data class.", labels=["data_class"])
    # Summed over the system's pass and the overriding tenants' (tenants are no label: their number is unbounded).
    by_class = RetentionMark.objects.values("data_class").annotate(n=Sum("purged")).order_by("data_class")
    for row in by_class:
        purged.add_metric([row["data_class"]], row["n"])
    return purged


def liveness_repairs() -> Metric:
    """Rows the sweeper found with no way forward and repaired, by the rule they broke (tasks/liveness.py).

    A counter over the alerts each repair raised (alert_liveness_idx); acknowledging an alert keeps it counted.
    """
    repairs = CounterMetricFamily("longhaul_liveness_repairs",
                                  "Rows found with no way forward and repaired by the sweeper, by rule.",
                                  labels=["rule"])
    rows = Alert.objects.filter(kind=Alert.Kind.LIVENESS).order_by().values("rule").annotate(n=Count("*"))
    for row in rows:
        repairs.add_metric([row["rule"] or "unknown"], row["n"])
    return repairs


# --- model and tool pools ---------------------------------------------------------


def pool_metrics(*, now: datetime) -> Iterator[Metric]:
    """Model, tool and MCP pools, each by its name (tasks/pools.py): limits, calls in flight and waiting,
    pauses a provider's 429 asked for, call latency."""
    live = Q(status=OperationStatus.STARTED, mode=Operation.Mode.GATEWAY)  # operation_pool_inflight_idx
    # Only calls of tasks still waiting for them get claimed (or taken over); count the same.
    waiting_task = operations.waiting_task()
    in_flight = _count_by(Operation.objects.filter(live, lease_expires_at__gte=now), "pool")
    orphaned = _count_by(Operation.objects.filter(live, waiting_task, lease_expires_at__lt=now), "pool")
    pending = _count_by(Operation.objects.filter(waiting_task, status=OperationStatus.PENDING,
                                                 mode=Operation.Mode.GATEWAY), "pool")
    states = {pool.key: pool for pool in Pool.objects.all()}
    labels = ["kind", "pool"]
    families = {
        "size": GaugeMetricFamily("longhaul_pool_size", "Calls a pool runs at once, across all processes.",
                                  labels=labels),
        "in_flight": GaugeMetricFamily("longhaul_pool_in_flight", "Calls running under a live lease.",
                                       labels=labels),
        "saturation": GaugeMetricFamily("longhaul_pool_saturation", "In-flight calls over pool size (0 to 1).",
                                        labels=labels),
        "pending": GaugeMetricFamily("longhaul_pool_pending", "Calls waiting for a slot in the pool.",
                                     labels=labels),
        "orphaned": GaugeMetricFamily("longhaul_pool_expired_leases",
                                      "Started calls whose gateway job stopped renewing (to be taken over).",
                                      labels=labels),
        "rpm": GaugeMetricFamily("longhaul_pool_requests_per_minute_limit",
                                 "Calls a pool may start per minute (0: no limit).", labels=labels),
        "tpm": GaugeMetricFamily("longhaul_pool_tokens_per_minute_limit",
                                 "Tokens a model pool may spend per minute (0: no limit).", labels=labels),
        "paused": GaugeMetricFamily("longhaul_pool_paused_seconds",
                                    "Seconds left of a pause a provider's 429 asked for (0: not paused).",
                                    labels=labels),
    }
    pauses = CounterMetricFamily("longhaul_pool_rate_limited",
                                 "429s with Retry-After that paused a pool, since it was first used.", labels=labels)
    # Pools used so far (their rows, read once above), those configured, and those with calls.
    keys = sorted(set(pools.known()) | set(states) | set(in_flight) | set(pending) | set(orphaned))
    for key in keys:
        limits, flying, state = pools.limits(key), in_flight.get(key, 0), states.get(key)
        left = max(0.0, (state.paused_until - now).total_seconds()) if state and state.paused_until else 0.0
        for name, value in (("size", limits.concurrency), ("in_flight", flying),
                            ("saturation", flying / limits.concurrency), ("pending", pending.get(key, 0)),
                            ("orphaned", orphaned.get(key, 0)), ("rpm", limits.requests_per_minute),
                            ("tpm", limits.tokens_per_minute), ("paused", left)):
            families[name].add_metric([pools.kind_of(key), key], value)
        pauses.add_metric([pools.kind_of(key), key], state.pauses if state else 0)
    yield from families.values()
    yield pauses
    yield from _call_latency(now=now)


def _call_latency(*, now: datetime) -> Iterator[Metric]:
    """Duration of the newest finished calls (at most SAMPLE, within WINDOW), by pool and call name; and the
    time they spent in their gateway job beside it, by pool and part."""
    window = f"at most {SAMPLE}, within {int(WINDOW.total_seconds())} s"
    family = GaugeHistogramMetricFamily(
        "longhaul_operation_duration_seconds",
        f"Duration of the newest finished model and tool calls ({window}).", labels=["pool", "name"])
    in_job = GaugeHistogramMetricFamily(
        "longhaul_gateway_wait_seconds",
        f"Time the newest finished calls ({window}) spent in their gateway job beside their remote work: from their "
        "claim to their start (part=before_start: the claim's own statements, then the job's event loop busy with "
        "other calls) and from their answer to their record's start (part=before_record: the job's recorder busy "
        "with other answers).",
        labels=["pool", "part"])
    # Newest first by primary key: the scan stops after SAMPLE finished rows.
    rows = (Operation.objects.filter(status__in=operations.FINISHED, mode=Operation.Mode.GATEWAY)
            .order_by("-id").values_list("pool", "name", "usage", "finished_at")[:SAMPLE])
    durations: dict[tuple[str, str], list[float]] = defaultdict(list)
    waits: dict[tuple[str, str], list[float]] = defaultdict(list)
    for pool, name, usage, finished_at in rows:
        if finished_at is None or finished_at < now - WINDOW:
            continue
        usage = usage or {}
        ms = usage.get("duration_ms")
        if isinstance(ms, int | float):
            durations[(pool, name)].append(ms / 1000)
        for part, key in (("before_start", "started_after_ms"), ("before_record", "recorded_after_ms")):
            if isinstance(usage.get(key), int | float):
                waits[(pool, part)].append(usage[key] / 1000)
    for (pool, name), seconds in sorted(durations.items()):
        family.add_metric([pool, name], _buckets(seconds, CALL_BUCKETS), sum(seconds))
    for (pool, part), seconds in sorted(waits.items()):
        in_job.add_metric([pool, part], _buckets(seconds, CALL_BUCKETS), sum(seconds))
    yield family
    yield in_job


# --- helpers ----------------------------------------------------------------------


def _count_by(rows, *fields: str, **expressions) -> dict:
    """COUNT(*) grouped by the fields (and named expressions); keys are values, or tuples of them.

    COUNT(*), not COUNT(id): over a partial index it allows an index-only scan.
    """
    names = [*fields, *expressions]
    grouped = rows.order_by().values(*fields, **expressions).annotate(n=Count("*"))
    if len(names) == 1:
        return {row[names[0]]: row["n"] for row in grouped}
    return {tuple(row[name] for name in names): row["n"] for row in grouped}


def _count_by_tenant(rows) -> dict[int, int]:
    return _count_by(rows, "tenant_id")


def _buckets(values: Sequence[float], bounds: Iterable[float]) -> list[tuple[str, float]]:
    """Cumulative histogram buckets, ending with +Inf."""
    buckets = [(_bound(b), float(sum(1 for v in values if v <= b))) for b in bounds]
    return [*buckets, ("+Inf", float(len(values)))]


def _bound(value: float) -> str:
    return repr(float(value))
