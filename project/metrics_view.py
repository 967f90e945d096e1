"""GET /metrics: Prometheus text exposition, for staff sessions (scoped to their tenants) or the metrics
bearer token."""

from __future__ import annotations

import hmac
import os

from django.conf import settings
from django.http import HttpRequest, HttpResponse
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_safe
from prometheus_client import CONTENT_TYPE_LATEST

from tasks import metrics as task_metrics
from tasks.models import Membership

BEARER = "bearer "


def metrics_token() -> str:
    """The scrape token: the setting if set, else the environment; empty disables token access."""
    return getattr(settings, "LONGHAUL_METRICS_TOKEN", "") or os.environ.get("LONGHAUL_METRICS_TOKEN", "")


def bearer_ok(request: HttpRequest) -> bool:
    """Whether the request carries the configured token, compared in constant time."""
    expected = metrics_token()
    header = request.META.get("HTTP_AUTHORIZATION", "")
    if not expected or not header.lower().startswith(BEARER):
        return False
    return hmac.compare_digest(header[len(BEARER):].strip().encode(), expected.encode())


@never_cache
@require_safe
def metrics(request: HttpRequest) -> HttpResponse:
    """Every Longhaul metric; 401 without credentials, 403 for a signed-in non-staff user."""
    if not (bearer_ok(request) or request.user.is_staff):
        if request.user.is_authenticated:
            return HttpResponse("staff only\n", status=403, content_type="text/plain")
        response = HttpResponse("authentication required\n", status=401, content_type="text/plain")
        response["WWW-Authenticate"] = 'Bearer realm="metrics"'
        return response
    return HttpResponse(task_metrics.render(tenants=_scope(request)), content_type=CONTENT_TYPE_LATEST)


def _scope(request: HttpRequest) -> frozenset[str] | None:
    """The tenants whose series this scrape may see: all (None) for the token and superusers; a staff
    member, only the tenants they administer (the admin's rule, tasks/admin/scoping.py)."""
    if bearer_ok(request) or request.user.is_superuser:
        return None
    return frozenset(Membership.objects.filter(user=request.user, role=Membership.Role.ADMIN)
                     .values_list("tenant__slug", flat=True))
