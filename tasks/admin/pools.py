"""Gateway pools: each pool's limits (from the settings), its calls in flight and waiting, and its pause."""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse

from tasks import clock, pools
from tasks.admin.display import format_time
from tasks.models import Operation, Pool
from tasks.statuses import OperationStatus


@admin.register(Pool)
class PoolAdmin(admin.ModelAdmin):
    """Read-only, and for superusers only: a pool serves every tenant, so its load is the system's.
    Limits are settings (LONGHAUL_POOLS and the per-kind defaults), shown here beside what the pool does."""

    list_display = ("key", "kind", "concurrency", "requests_per_minute", "tokens_per_minute", "in_flight",
                    "waiting", "paused", "pause_reason", "pauses")
    readonly_fields = list_display
    fields = list_display
    search_fields = ("key",)

    def changelist_view(self, request: HttpRequest, extra_context: dict[str, Any] | None = None) -> HttpResponse:
        # Configured pools are listed before their first call, with the limits they will have.
        Pool.objects.bulk_create([Pool(key=key) for key in pools.known()], ignore_conflicts=True)
        return super().changelist_view(request, extra_context)

    def get_queryset(self, request: HttpRequest) -> QuerySet:
        return super().get_queryset(request).order_by("key")

    def has_module_permission(self, request: HttpRequest) -> bool:
        return request.user.is_active and request.user.is_superuser

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return request.user.is_active and request.user.is_superuser

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    @admin.display(description="kind")
    def kind(self, pool: Pool) -> str:
        return pools.kind_of(pool.key)

    @admin.display(description="concurrency")
    def concurrency(self, pool: Pool) -> int:
        return pools.limits(pool.key).concurrency

    @admin.display(description="requests / min")
    def requests_per_minute(self, pool: Pool) -> str:
        return str(pools.limits(pool.key).requests_per_minute or "no limit")

    @admin.display(description="tokens / min")
    def tokens_per_minute(self, pool: Pool) -> str:
        limit = pools.limits(pool.key).tokens_per_minute
        return str(limit) if limit else ("no limit" if pools.kind_of(pool.key) == "model" else "-")

    @admin.display(description="in flight")
    def in_flight(self, pool: Pool) -> int:
        return Operation.objects.filter(pool=pool.key, status=OperationStatus.STARTED, mode=Operation.Mode.GATEWAY,
                                        lease_expires_at__gte=clock.now()).count()

    @admin.display(description="waiting")
    def waiting(self, pool: Pool) -> int:
        return Operation.objects.filter(pool=pool.key, status=OperationStatus.PENDING,
                                        mode=Operation.Mode.GATEWAY).count()

    @admin.display(description="paused until")
    def paused(self, pool: Pool) -> str:
        return format_time(pool.paused_until) if pools.paused(pool, now=clock.now()) else "-"
