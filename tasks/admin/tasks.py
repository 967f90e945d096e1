"""Tasks: the list with its trouble views (dead letters, failures, stalls), the change page, the actions."""

from __future__ import annotations

from typing import Any, ClassVar

from django.contrib import admin
from django.db.models import Count, Max, QuerySet
from django.http import HttpRequest
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString

from tasks import actions, clock
from tasks.admin.display import admin_url, counted, format_duration, format_time, link, short_json
from tasks.admin.outcomes import OutcomeTally, Phrase, run_for_each
from tasks.admin.scoping import OperatorTenantFilter, ReadOnlyAdmin
from tasks.drivers import available_kinds
from tasks.models import Checkpoint, Operation, Task, TaskEvent
from tasks.statuses import ACTIVE, TERMINAL, ErrorClass, NotificationStatus, TaskStatus

OPERATOR_REASON = "by an operator in the admin"
RECENT_EVENTS_SHOWN = 20


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
                 "pause_requested_at", "pause_requested_by", "pause_reason", "yield_requested_at"),
    "Input, budget and result": ("input", "budget", "result", "result_version"),
    "Code and model": ("code_version", "schema_version", "model_name", "prompt_version", "tool_protocol"),
    "Notification": ("notification_status", "event_version", "notified_version", "notification_attempt_count",
                     "next_notification_at", "notification_error", "notification_runs",
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
        return format_html("{}, the last for step {} at {}", link(url, counted(stats["n"], "checkpoint")),
                           stats["step"], format_time(stats["at"]))

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
            actions.requeue_failed(task, user=request.user)
            return "requeued"

        run_for_each(self, request, queryset, requeue, OutcomeTally(("task", "tasks"), {
            "requeued": Phrase("{n} {noun} requeued with a fresh retry budget",
                               "{n} {noun} requeued with a fresh retry budget", done=True),
            "not_failed": Phrase("{n} {noun} had not failed", "{n} {noun} had not failed"),
        }))

    @admin.action(description="Retry dead-lettered notifications", permissions=["operate"])
    def retry_notifications(self, request: HttpRequest, queryset: QuerySet) -> None:
        def retry(task: Task) -> str:
            actions.retry_notification(task, user=request.user)
            return "retried"

        run_for_each(self, request, queryset, retry, OutcomeTally(("notification", "notifications"), {
            "retried": Phrase("{n} {noun} will be delivered again", "{n} {noun} will be delivered again",
                              done=True),
            "not_dead_lettered": Phrase("{n} {noun} was not dead-lettered", "{n} {noun} were not dead-lettered"),
        }))

    @admin.action(description="Release stuck leases (fences the old holder)", permissions=["operate"])
    def release_leases(self, request: HttpRequest, queryset: QuerySet) -> None:
        def release(task: Task) -> str:
            actions.release_lease(task, user=request.user)
            return "released"

        run_for_each(self, request, queryset, release, OutcomeTally(("lease", "leases"), {
            "released": Phrase("{n} {noun} released", "{n} {noun} released", done=True),
            "not_leased": Phrase("{n} task held no lease", "{n} tasks held no lease"),
        }))
