"""The operators' admin: tasks and what they did, dead letters, alerts, tenant quotas, the audit log.

Runtime rows are read-only here: they change only through the runtime (tasks.actions,
tasks.admin_actions), which the actions below call, each leaving an AuditEntry that
names the acting admin. A staff user sees and acts only within the tenants where
they are a Membership admin; a superuser sees everything.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime
from functools import wraps
from typing import Any, ClassVar
from urllib.parse import urlencode

from django.contrib import admin, messages
from django.contrib.auth import get_permission_codename
from django.db.models import Count, IntegerField, Max, OuterRef, QuerySet, Subquery
from django.db.models.functions import Coalesce
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.defaultfilters import pluralize
from django.urls import NoReverseMatch, reverse
from django.utils import timezone
from django.utils.dateformat import format as format_date
from django.utils.html import format_html, format_html_join
from django.utils.http import url_has_allowed_host_and_scheme
from django.utils.safestring import SafeString

from tasks import actions, admin_actions, clock
from tasks.drivers import available_kinds
from tasks.errors import Conflict, LonghaulError
from tasks.models import (
    Alert,
    AuditEntry,
    Checkpoint,
    Membership,
    Operation,
    Task,
    TaskEvent,
    Tenant,
)
from tasks.statuses import ACTIVE, HOLDS_SLOT, TERMINAL, ErrorClass, NotificationStatus, TaskStatus

log = logging.getLogger(__name__)

OPERATOR_REASON = "by an operator in the admin"
RECENT_EVENTS_SHOWN = 20
OPEN_ALERTS_SHOWN = 20


# --- tenant scoping -------------------------------------------------------------------


def operator_tenant_ids(request: HttpRequest) -> frozenset[int] | None:
    """The tenants this admin user operates; None means all (a superuser).

    Only admin memberships count: a tenant's plain member who also has is_staff (for
    another tenant, say) must not see that tenant's other users' tasks and audit log.
    """
    user = request.user
    if user.is_superuser:
        return None
    cached: frozenset[int] | None = getattr(request, "_operator_tenant_ids", None)
    if cached is None:
        cached = frozenset(
            Membership.objects.filter(user=user, role=Membership.Role.ADMIN).values_list("tenant_id", flat=True)
        )
        request._operator_tenant_ids = cached  # type: ignore[attr-defined]
    return cached


def scoped(queryset: QuerySet, tenant_lookup: str, request: HttpRequest) -> QuerySet:
    ids = operator_tenant_ids(request)
    return queryset if ids is None else queryset.filter(**{f"{tenant_lookup}__in": ids})


class OperatorTenantFilter(admin.RelatedFieldListFilter):
    """Offers only the operator's tenants, read from the small tenant table (the stock
    related-only filter would scan the big table for its distinct tenants)."""

    def field_choices(self, field: Any, request: HttpRequest, model_admin: admin.ModelAdmin) -> list[tuple[Any, str]]:
        tenants = Tenant.objects.order_by("slug")
        ids = operator_tenant_ids(request)
        if ids is not None:
            tenants = tenants.filter(pk__in=ids)
        return [(tenant.pk, str(tenant)) for tenant in tenants]


class TenantScopedAdmin(admin.ModelAdmin):
    """Rows outside the operator's tenants are absent from lists, change views and actions.

    `operate` is the permission the runtime actions ask for: the model's change
    permission within scope. It is separate from has_change_permission so that the
    change form can stay read-only while actions are allowed.
    """

    tenant_lookup: ClassVar[str] = "tenant"

    def get_queryset(self, request: HttpRequest) -> QuerySet:
        return scoped(super().get_queryset(request), self.tenant_lookup, request)

    def tenant_id_of(self, obj: Any) -> int | None:
        *hops, last = self.tenant_lookup.split("__")
        for hop in hops:
            obj = getattr(obj, hop)
        return getattr(obj, f"{last}_id")

    def in_scope(self, request: HttpRequest, obj: Any) -> bool:
        ids = operator_tenant_ids(request)
        return ids is None or self.tenant_id_of(obj) in ids

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return super().has_view_permission(request, obj) and (obj is None or self.in_scope(request, obj))

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return super().has_change_permission(request, obj) and (obj is None or self.in_scope(request, obj))

    def has_operate_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        opts = self.opts
        allowed = request.user.has_perm(f"{opts.app_label}.{get_permission_codename('change', opts)}")
        return allowed and (obj is None or self.in_scope(request, obj))


class ReadOnlyAdmin(TenantScopedAdmin):
    """Runtime rows are written only through transitions: no add, no edit, no delete here."""

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


# --- what an action did, in one sentence ----------------------------------------------


@dataclass(frozen=True)
class Phrase:
    one: str
    many: str
    done: bool = False  # the row was changed as asked


COMMON_PHRASES = {
    "not_permitted": Phrase("{n} {noun} is outside your tenants", "{n} {noun} are outside your tenants"),
    "changed": Phrase("{n} {noun} changed meanwhile; try again", "{n} {noun} changed meanwhile; try again"),
    "error": Phrase("{n} {noun} could not be changed (see the log)", "{n} {noun} could not be changed (see the log)"),
}


@dataclass
class OutcomeTally:
    """Counts what an action did to each row: "3 tasks cancelled, 1 task was already finished"."""

    noun: tuple[str, str]
    phrases: dict[str, Phrase]
    counts: Counter[str] = field(default_factory=Counter)

    def add(self, outcome: str) -> None:
        self.counts[outcome] += 1

    def _phrase(self, outcome: str) -> Phrase:
        fallback = Phrase(f"{{n}} {{noun}} not changed ({outcome})", f"{{n}} {{noun}} not changed ({outcome})")
        return self.phrases.get(outcome) or COMMON_PHRASES.get(outcome) or fallback

    def sentence(self) -> str:
        if not self.counts:
            return f"No {self.noun[1]} were changed."
        known = [*self.phrases, *COMMON_PHRASES]
        ordered = sorted(self.counts, key=lambda o: known.index(o) if o in known else len(known))
        parts = []
        for outcome in ordered:
            n = self.counts[outcome]
            phrase = self._phrase(outcome)
            parts.append((phrase.one if n == 1 else phrase.many).format(n=n, noun=self.noun[0 if n == 1 else 1]))
        return ", ".join(parts) + "."

    def level(self) -> int:
        return messages.SUCCESS if any(self._phrase(o).done for o in self.counts) else messages.WARNING


def run_for_each(model_admin: TenantScopedAdmin, request: HttpRequest, queryset: QuerySet,
                 call: Callable[[Any], str], tally: OutcomeTally) -> None:
    """Apply `call` to each selected row the user may operate, tally the outcomes and say them.

    One row's refusal (Conflict) or lost race does not stop the others.
    """
    for obj in queryset.order_by("pk"):
        if not model_admin.has_operate_permission(request, obj):
            tally.add("not_permitted")
            continue
        try:
            tally.add(call(obj))
        except Conflict as exc:
            tally.add(exc.code)
        except LonghaulError:
            log.warning("admin action on %s %s failed", model_admin.opts.model_name, obj.pk, exc_info=True)
            tally.add("error")
    model_admin.message_user(request, tally.sentence(), tally.level())


# --- display helpers ------------------------------------------------------------------


def format_duration(seconds: float) -> str:
    whole = int(seconds)
    if whole < 60:
        return f"{whole}s"
    minutes, secs = divmod(whole, 60)
    if minutes < 60:
        return f"{minutes}m {secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 48:
        return f"{hours}h {minutes:02d}m"
    days, hours = divmod(hours, 24)
    return f"{days}d {hours}h"


def format_time(value: datetime | None) -> str:
    return format_date(timezone.localtime(value), "Y-m-d H:i:s") if value else "-"


def short_json(value: Any, limit: int = 160) -> str:
    text = json.dumps(value, ensure_ascii=False, sort_keys=True, default=str)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def counted(n: int, noun: str) -> str:
    return f"{n} {noun}{pluralize(n)}"


def admin_url(name: str, *args: Any, query: dict[str, Any] | None = None) -> str:
    """An admin URL, or "" when that admin is not registered (chat's, say)."""
    try:
        url = reverse(f"admin:{name}", args=args)
    except NoReverseMatch:
        return ""
    return f"{url}?{urlencode(query)}" if query else url


def link(url: str, text: str) -> SafeString | str:
    return format_html('<a href="{}">{}</a>', url, text) if url else text


# --- tasks ----------------------------------------------------------------------------


class TroubleFilter(admin.SimpleListFilter):
    """The dead-letter view and its neighbours: rows an operator should look at."""

    title = "needs attention"
    parameter_name = "trouble"
    CHOICES: ClassVar[dict[str, str]] = {
        "dead_letter": "Dead-lettered notification",
        "failed": "Failed",
        "poison": "Poison (gave up on a crashing step)",
        "stalled": "Stalled",
        "expired_lease": "Lease expired, not yet taken over",
    }

    def lookups(self, request: HttpRequest, model_admin: admin.ModelAdmin) -> list[tuple[str, str]]:
        return list(self.CHOICES.items())

    def queryset(self, request: HttpRequest, queryset: QuerySet) -> QuerySet:
        match self.value():
            case "dead_letter":
                return queryset.filter(notification_status=NotificationStatus.DEAD_LETTER)
            case "failed":
                return queryset.filter(status=TaskStatus.FAILED)
            case "poison":
                return queryset.filter(status=TaskStatus.FAILED, error_class=ErrorClass.POISON)
            case "stalled":
                return queryset.filter(stalled_at__isnull=False, status__in=ACTIVE)
            case "expired_lease":
                return queryset.exclude(lease_owner="").filter(lease_expires_at__lt=clock.now())
        return queryset


class KindFilter(admin.SimpleListFilter):
    """Kinds from the driver registry: a DISTINCT over the task table would scan all of it."""

    title = "kind"
    parameter_name = "kind"

    def lookups(self, request: HttpRequest, model_admin: admin.ModelAdmin) -> list[tuple[str, str]]:
        return [(kind, kind) for kind in available_kinds()]

    def queryset(self, request: HttpRequest, queryset: QuerySet) -> QuerySet:
        return queryset.filter(kind=self.value()) if self.value() else queryset


TASK_FIELD_GROUPS: dict[str, tuple[str, ...]] = {
    "Task": ("name", "public_id", "tenant", "owner", "thread", "kind", "status", "priority",
             "created_at", "started_at", "finished_at", "updated_at", "duration"),
    "Error": ("error_class", "error_message", "error_detail"),
    "Execution": ("current_step", "waiting_reason", "attempts", "retries", "next_run_at", "queue_deadline_at",
                  "lease_owner", "lease_expires_at", "fencing_token", "heartbeat_at", "last_progress_at",
                  "stalled_at", "version"),
    "Requests": ("cancel_requested_at", "cancel_requested_by", "cancel_reason", "cancel_keep_results",
                 "pause_requested_at", "pause_requested_by", "pause_reason"),
    "Input, budget and result": ("input", "budget", "result", "result_version"),
    "Code and model": ("code_version", "schema_version", "model_name", "prompt_version", "tool_protocol"),
    "Notification": ("notification_status", "event_version", "notified_version", "notification_attempt_count",
                     "next_notification_at", "notification_error", "notification_run", "notification_runs",
                     "dispatch_version", "dispatch_attempt", "dispatch_event", "event_fingerprint",
                     "notification_lease_owner", "notification_lease_expires_at"),
    "History": ("recent_events", "checkpoints", "operations", "audit"),
}
# Internal (tracebacks); the model says it never leaves the server, so only superusers read it here.
SUPERUSER_ONLY_FIELDS = frozenset({"error_detail"})


@admin.register(Task)
class TaskAdmin(ReadOnlyAdmin):
    list_display = ("name", "status", "kind", "tenant", "owner", "priority", "created_at", "duration",
                    "error_class", "notification_status")
    trouble_list_display = ("name", "tenant", "status", "error_class", "error_summary", "notification_status",
                            "attempts_summary", "last_attempt")
    list_filter = (TroubleFilter, "status", KindFilter, ("tenant", OperatorTenantFilter), "error_class",
                   "notification_status")
    list_select_related = ("tenant", "owner")
    search_fields = ("name",)
    ordering = ("-created_at",)
    show_full_result_count = False  # an unfiltered count(*) of the whole table on every page is not worth it
    readonly_fields = ("duration", "notification_runs", "recent_events", "checkpoints", "operations", "audit")
    actions = ("cancel_tasks", "pause_tasks", "resume_tasks", "requeue_failed_tasks", "retry_notifications",
               "release_leases")

    def get_list_display(self, request: HttpRequest) -> tuple[str, ...]:
        if request.GET.get(TroubleFilter.parameter_name):
            return self.trouble_list_display
        return self.list_display

    def get_fieldsets(self, request: HttpRequest, obj: Any = None) -> list[tuple[str, dict[str, Any]]]:
        hidden = set() if request.user.is_superuser else SUPERUSER_ONLY_FIELDS
        named = {name for names in TASK_FIELD_GROUPS.values() for name in names}
        # Columns added to the model later show up under "More" rather than not at all.
        more = tuple(f.name for f in Task._meta.concrete_fields if f.name not in named and f.name != "id")
        groups = {**TASK_FIELD_GROUPS, "More": more} if more else TASK_FIELD_GROUPS
        return [(title, {"fields": tuple(n for n in names if n not in hidden)}) for title, names in groups.items()]

    # list columns

    @admin.display(description="duration")
    def duration(self, task: Task) -> str:
        if not task.started_at:
            return "-"
        return format_duration(((task.finished_at or clock.now()) - task.started_at).total_seconds())

    @admin.display(description="error")
    def error_summary(self, task: Task) -> str:
        if task.notification_status == NotificationStatus.DEAD_LETTER and task.notification_error:
            return task.notification_error[:200]
        return task.error_message[:200]

    @admin.display(description="attempts")
    def attempts_summary(self, task: Task) -> str:
        if task.notification_status == NotificationStatus.DEAD_LETTER:
            return f"{task.notification_attempt_count} deliveries"
        return f"{task.retries} retries, {task.attempts} claims of the last step"

    @admin.display(description="last attempt")
    def last_attempt(self, task: Task) -> str:
        if task.notification_status == NotificationStatus.DEAD_LETTER:
            # The row keeps no time of its last delivery; the last one was due at next_notification_at.
            return format_time(task.next_notification_at)
        return format_time(task.finished_at or task.heartbeat_at)

    # change page: what the task did, linked rather than inlined (a task may have thousands of events)

    @admin.display(description="events")
    def recent_events(self, task: Task) -> SafeString:
        newest = list(TaskEvent.objects.filter(task_id=task.pk).order_by("-seq")[:RECENT_EVENTS_SHOWN])
        rows = format_html_join(
            "", "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            ((e.seq, format_time(e.at), e.kind, e.status, short_json(e.data)) for e in reversed(newest)),
        )
        all_events = link(admin_url("tasks_taskevent_changelist", query={"task__id__exact": task.pk}),
                          f"all {counted(task.last_event_seq, 'event')}")
        return format_html(
            "<table><thead><tr><th>seq</th><th>at</th><th>kind</th><th>status</th><th>data</th></tr></thead>"
            "<tbody>{}</tbody></table><p>The last {} by seq; {}</p>",
            rows, min(len(newest), RECENT_EVENTS_SHOWN), all_events,
        )

    @admin.display(description="checkpoints")
    def checkpoints(self, task: Task) -> SafeString | str:
        stats = Checkpoint.objects.filter(task_id=task.pk).aggregate(n=Count("pk"), step=Max("step"), at=Max("at"))
        if not stats["n"]:
            return "none yet"
        url = admin_url("tasks_checkpoint_changelist", query={"task__id__exact": task.pk})
        return format_html("{}, the last for step {} at {}", link(url, counted(stats["n"], "checkpoint")), stats["step"],
                           format_time(stats["at"]))

    @admin.display(description="operations")
    def operations(self, task: Task) -> SafeString | str:
        by_status = dict(Operation.objects.filter(task_id=task.pk).order_by().values_list("status")
                         .annotate(n=Count("pk")).values_list("status", "n"))
        if not by_status:
            return "none"
        url = admin_url("tasks_operation_changelist", query={"task__id__exact": task.pk})
        counts = ", ".join(f"{n} {status}" for status, n in sorted(by_status.items()))
        return format_html("{} ({})", link(url, counted(sum(by_status.values()), "operation")), counts)

    @admin.display(description="notification runs")
    def notification_runs(self, task: Task) -> SafeString | str:
        # By URL name: tasks never imports chat (DESIGN §3).
        url = admin_url("chat_run_changelist", query={"task__id__exact": task.pk, "kind__exact": "notification"})
        return link(url, "notification runs of this task")

    @admin.display(description="audit")
    def audit(self, task: Task) -> SafeString | str:
        url = admin_url("tasks_auditentry_changelist", query={"target_id__exact": str(task.public_id)})
        return link(url, "audit entries for this task")

    # actions: each calls the runtime, which checks the state under a row lock and audits

    @admin.action(description="Cancel selected tasks", permissions=["operate"])
    def cancel_tasks(self, request: HttpRequest, queryset: QuerySet) -> None:
        def cancel(task: Task) -> str:
            if task.status in TERMINAL:
                return "already_finished"
            fresh = actions.request_cancel(task, user=request.user, reason=f"cancelled {OPERATOR_REASON}")
            if fresh.status == TaskStatus.CANCELLED:
                return "cancelled"
            return "already_finished" if fresh.status in TERMINAL else "cancel_requested"

        run_for_each(self, request, queryset, cancel, OutcomeTally(("task", "tasks"), {
            "cancelled": Phrase("{n} {noun} cancelled", "{n} {noun} cancelled", done=True),
            "cancel_requested": Phrase("{n} {noun} will stop at its next safe point",
                                       "{n} {noun} will stop at their next safe point", done=True),
            "already_finished": Phrase("{n} {noun} was already finished", "{n} {noun} were already finished"),
        }))

    @admin.action(description="Pause selected tasks", permissions=["operate"])
    def pause_tasks(self, request: HttpRequest, queryset: QuerySet) -> None:
        def pause(task: Task) -> str:
            fresh = actions.request_pause(task, user=request.user, reason=f"paused {OPERATOR_REASON}")
            return "paused" if fresh.status == TaskStatus.PAUSED else "pause_requested"

        run_for_each(self, request, queryset, pause, OutcomeTally(("task", "tasks"), {
            "paused": Phrase("{n} {noun} paused", "{n} {noun} paused", done=True),
            "pause_requested": Phrase("{n} {noun} will pause at its next safe point",
                                      "{n} {noun} will pause at their next safe point", done=True),
            "not_pausable": Phrase("{n} {noun} was not running", "{n} {noun} were not running"),
        }))

    @admin.action(description="Resume selected paused or partial tasks", permissions=["operate"])
    def resume_tasks(self, request: HttpRequest, queryset: QuerySet) -> None:
        def resume(task: Task) -> str:
            actions.resume(task, user=request.user)
            return "resumed"

        run_for_each(self, request, queryset, resume, OutcomeTally(("task", "tasks"), {
            "resumed": Phrase("{n} {noun} resumed", "{n} {noun} resumed", done=True),
            "not_resumable": Phrase("{n} {noun} was not paused or partial", "{n} {noun} were not paused or partial"),
        }))

    @admin.action(description="Requeue selected failed tasks from their last checkpoint", permissions=["operate"])
    def requeue_failed_tasks(self, request: HttpRequest, queryset: QuerySet) -> None:
        def requeue(task: Task) -> str:
            admin_actions.requeue_failed(task, user=request.user)
            return "requeued"

        run_for_each(self, request, queryset, requeue, OutcomeTally(("task", "tasks"), {
            "requeued": Phrase("{n} {noun} requeued with a fresh retry budget",
                               "{n} {noun} requeued with a fresh retry budget", done=True),
            "not_failed": Phrase("{n} {noun} had not failed", "{n} {noun} had not failed"),
        }))

    @admin.action(description="Retry dead-lettered notifications", permissions=["operate"])
    def retry_notifications(self, request: HttpRequest, queryset: QuerySet) -> None:
        def retry(task: Task) -> str:
            admin_actions.retry_notification(task, user=request.user)
            return "retried"

        run_for_each(self, request, queryset, retry, OutcomeTally(("notification", "notifications"), {
            "retried": Phrase("{n} {noun} will be delivered again", "{n} {noun} will be delivered again",
                              done=True),
            "not_dead_lettered": Phrase("{n} {noun} was not dead-lettered", "{n} {noun} were not dead-lettered"),
        }))

    @admin.action(description="Release stuck leases (fences the old holder)", permissions=["operate"])
    def release_leases(self, request: HttpRequest, queryset: QuerySet) -> None:
        def release(task: Task) -> str:
            admin_actions.release_lease(task, user=request.user)
            return "released"

        run_for_each(self, request, queryset, release, OutcomeTally(("lease", "leases"), {
            "released": Phrase("{n} {noun} released", "{n} {noun} released", done=True),
            "not_leased": Phrase("{n} task held no lease", "{n} tasks held no lease"),
        }))


class TaskRowAdmin(ReadOnlyAdmin):
    """Rows that belong to a task: reached from the task's page through `?task__id__exact=`."""

    tenant_lookup = "task__tenant"
    list_select_related = ("task",)
    show_full_result_count = False


@admin.register(TaskEvent)
class TaskEventAdmin(ReadOnlyAdmin):
    list_display = ("task", "seq", "kind", "status", "at", "data_excerpt")
    list_filter = (("tenant", OperatorTenantFilter), "status")
    list_select_related = ("task",)
    search_fields = ("=kind",)
    show_full_result_count = False

    @admin.display(description="data")
    def data_excerpt(self, event: TaskEvent) -> str:
        return short_json(event.data)


@admin.register(Checkpoint)
class CheckpointAdmin(TaskRowAdmin):
    list_display = ("task", "step", "schema_version", "fencing_token", "at")
    list_filter = (("task__tenant", OperatorTenantFilter),)


@admin.register(Operation)
class OperationAdmin(TaskRowAdmin):
    list_display = ("key", "task", "kind", "name", "status", "attempts", "error_class", "has_side_effects",
                    "created_at", "finished_at")
    list_filter = (("task__tenant", OperatorTenantFilter), "status", "kind")
    search_fields = ("=key", "name")


@admin.register(AuditEntry)
class AuditEntryAdmin(ReadOnlyAdmin):
    list_display = ("at", "tenant", "actor", "action", "target", "details_excerpt")
    list_filter = (("tenant", OperatorTenantFilter), ("actor", admin.RelatedOnlyFieldListFilter), "action",
                   "target_type")
    list_select_related = ("tenant", "actor")
    date_hierarchy = "at"
    search_fields = ("=target_id",)

    @admin.display(description="target")
    def target(self, entry: AuditEntry) -> SafeString | str:
        if entry.target_type == "task":
            return link(admin_url("tasks_task_changelist", query={"public_id": entry.target_id}),
                        f"task {entry.target_id}")
        return f"{entry.target_type} {entry.target_id}"

    @admin.display(description="details")
    def details_excerpt(self, entry: AuditEntry) -> str:
        return short_json(entry.details)


# --- alerts ---------------------------------------------------------------------------


class OpenFilter(admin.SimpleListFilter):
    title = "state"
    parameter_name = "state"

    def lookups(self, request: HttpRequest, model_admin: admin.ModelAdmin) -> list[tuple[str, str]]:
        return [("open", "Open"), ("acknowledged", "Acknowledged")]

    def queryset(self, request: HttpRequest, queryset: QuerySet) -> QuerySet:
        if self.value() == "open":
            return queryset.filter(acknowledged_at__isnull=True)
        if self.value() == "acknowledged":
            return queryset.filter(acknowledged_at__isnull=False)
        return queryset


# Where each kind of alert sends the operator: the task list filtered to that trouble.
ALERT_TROUBLE = {Alert.Kind.DEAD_LETTER: "dead_letter", Alert.Kind.POISON: "poison", Alert.Kind.STALLED: "stalled"}


def alert_view_url(alert: Alert) -> str:
    trouble = ALERT_TROUBLE.get(alert.kind)
    return admin_url("tasks_task_changelist", query={"trouble": trouble}) if trouble else ""


@admin.register(Alert)
class AlertAdmin(ReadOnlyAdmin):
    list_display = ("created_at", "kind", "tenant", "task", "message", "view", "acknowledged_at", "acknowledged_by")
    list_filter = (OpenFilter, "kind", ("tenant", OperatorTenantFilter))
    list_select_related = ("tenant", "task", "acknowledged_by")
    actions = ("acknowledge_alerts",)

    @admin.display(description="look at")
    def view(self, alert: Alert) -> SafeString | str:
        url = alert_view_url(alert)
        return link(url, TroubleFilter.CHOICES[ALERT_TROUBLE[alert.kind]]) if url else ""

    @admin.action(description="Acknowledge selected alerts", permissions=["operate"])
    def acknowledge_alerts(self, request: HttpRequest, queryset: QuerySet) -> HttpResponse | None:
        def acknowledge(alert: Alert) -> str:
            admin_actions.acknowledge_alert(alert, user=request.user)
            return "acknowledged"

        run_for_each(self, request, queryset, acknowledge, OutcomeTally(("alert", "alerts"), {
            "acknowledged": Phrase("{n} {noun} acknowledged", "{n} {noun} acknowledged", done=True),
            "already_acknowledged": Phrase("{n} {noun} was already acknowledged",
                                           "{n} {noun} were already acknowledged"),
        }))
        # The admin index acknowledges one alert at a time and wants its page back.
        back = request.POST.get("next", "")
        if back and url_has_allowed_host_and_scheme(back, allowed_hosts={request.get_host()},
                                                    require_https=request.is_secure()):
            return HttpResponseRedirect(back)
        return None


@dataclass(frozen=True)
class OpenAlert:
    pk: int
    kind: str
    tenant: str
    message: str
    created_at: datetime
    view_url: str
    view_label: str
    task_url: str


@dataclass(frozen=True)
class OpenAlerts:
    """What templates/admin/index.html shows above the app list."""

    rows: list[OpenAlert]
    total: int
    can_acknowledge: bool
    acknowledge_url: str
    list_url: str
    dead_letters_url: str

    @property
    def more(self) -> int:
        return self.total - len(self.rows)


def open_alerts_for(request: HttpRequest) -> OpenAlerts | None:
    """The operator's newest unacknowledged alerts, or None when there are none to show."""
    alert_admin = admin.site.get_model_admin(Alert)
    if not isinstance(alert_admin, AlertAdmin) or not alert_admin.has_view_permission(request):
        return None
    open_alerts = alert_admin.get_queryset(request).filter(acknowledged_at__isnull=True)
    newest = list(open_alerts.select_related("tenant", "task").order_by("-created_at")[:OPEN_ALERTS_SHOWN])
    if not newest:
        return None
    rows = [
        OpenAlert(
            pk=alert.pk, kind=alert.get_kind_display(), tenant=str(alert.tenant or "system"), message=alert.message,
            created_at=alert.created_at, view_url=alert_view_url(alert),
            view_label=TroubleFilter.CHOICES.get(ALERT_TROUBLE.get(alert.kind, ""), ""),
            task_url=admin_url("tasks_task_change", alert.task_id) if alert.task_id else "",
        )
        for alert in newest
    ]
    total = len(rows) if len(rows) < OPEN_ALERTS_SHOWN else open_alerts.count()
    return OpenAlerts(
        rows=rows, total=total, can_acknowledge=alert_admin.has_operate_permission(request),
        acknowledge_url=admin_url("tasks_alert_changelist"),
        list_url=admin_url("tasks_alert_changelist", query={"state": "open"}),
        dead_letters_url=admin_url("tasks_task_changelist", query={"trouble": "dead_letter"}),
    )


def show_open_alerts_on_index(site: admin.AdminSite) -> None:
    """Give the stock index view the open alerts that templates/admin/index.html shows.

    A wrap of the default site's view, because the project runs the stock AdminSite;
    an AdminSite subclass (or a template tag) would do the same from settings.
    """
    stock_index = site.index

    @wraps(stock_index)
    def index(request: HttpRequest, extra_context: dict[str, Any] | None = None) -> HttpResponse:
        return stock_index(request, extra_context={"open_alerts": open_alerts_for(request), **(extra_context or {})})

    site.index = index  # type: ignore[method-assign]


show_open_alerts_on_index(admin.site)


# --- tenants --------------------------------------------------------------------------


def tasks_of_tenant(statuses: Iterable[str]) -> Coalesce:
    """A per-tenant count as a correlated subquery: one query for the page, and each
    count can use its partial index (task_slot_idx, task_queued_idx)."""
    counted = (Task.objects.filter(tenant=OuterRef("pk"), status__in=sorted(statuses)).order_by()
               .values("tenant").annotate(n=Count("pk")).values("n"))
    return Coalesce(Subquery(counted, output_field=IntegerField()), 0)


@admin.register(Tenant)
class TenantAdmin(TenantScopedAdmin):
    list_display = ("slug", "name", "max_running", "max_queued", "weight", "running", "queued", "failed")
    fields = ("slug", "name", "created_at", *admin_actions.QUOTA_FIELDS)
    readonly_fields = ("slug", "name", "created_at")
    search_fields = ("slug", "name")

    def get_queryset(self, request: HttpRequest) -> QuerySet:
        ids = operator_tenant_ids(request)
        tenants = Tenant.objects.all() if ids is None else Tenant.objects.filter(pk__in=ids)
        return tenants.annotate(running_count=tasks_of_tenant(HOLDS_SLOT),
                                queued_count=tasks_of_tenant({TaskStatus.QUEUED}),
                                failed_count=tasks_of_tenant({TaskStatus.FAILED}))

    def tenant_id_of(self, obj: Any) -> int | None:
        return obj.pk

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def save_model(self, request: HttpRequest, obj: Tenant, form: Any, change: bool) -> None:
        quotas = {name: getattr(obj, name) for name in admin_actions.QUOTA_FIELDS if name in form.changed_data}
        if quotas:
            admin_actions.set_quotas(obj, user=request.user, quotas=quotas)

    @admin.display(description="running (slots held)", ordering="running_count")
    def running(self, tenant: Tenant) -> int:
        return tenant.running_count  # type: ignore[attr-defined]

    @admin.display(description="queued", ordering="queued_count")
    def queued(self, tenant: Tenant) -> int:
        return tenant.queued_count  # type: ignore[attr-defined]

    @admin.display(description="failed", ordering="failed_count")
    def failed(self, tenant: Tenant) -> SafeString | str:
        url = admin_url("tasks_task_changelist", query={"tenant__id__exact": tenant.pk, "status__exact": "failed"})
        return link(url, str(tenant.failed_count))  # type: ignore[attr-defined]
