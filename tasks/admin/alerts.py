"""Alerts: their list and acknowledgement, and the open ones shown above the admin index."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from functools import wraps
from typing import Any

from django.contrib import admin
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.utils.http import url_has_allowed_host_and_scheme
from django.utils.safestring import SafeString

from tasks import actions
from tasks.admin.display import admin_url, link
from tasks.admin.outcomes import OutcomeTally, Phrase, run_for_each
from tasks.admin.scoping import OperatorTenantFilter, ReadOnlyAdmin
from tasks.admin.tasks import TroubleFilter
from tasks.models import Alert

OPEN_ALERTS_SHOWN = 20


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
            actions.acknowledge_alert(alert, user=request.user)
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
