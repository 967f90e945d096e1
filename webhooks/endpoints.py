"""What tenants and operators do to endpoints: register, change, rotate the secret, remove.
The API and the admin call these; each leaves an AuditEntry naming who acted."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.db import transaction

from tasks import clock
from tasks.errors import Conflict, InvalidInput
from tasks.models import AuditEntry, Tenant
from webhooks import destinations, outbox, signing
from webhooks.models import EVENT_TYPES, Endpoint

ALL_EVENTS = tuple(EVENT_TYPES.values())


def clean_events(events: Any) -> list[str]:
    """A non-empty list of known event types, each once, in the order of ALL_EVENTS."""
    if not isinstance(events, list) or not events or not all(isinstance(e, str) for e in events):
        raise InvalidInput("events must be a non-empty list of event types", field="events")
    unknown = sorted(set(events) - set(ALL_EVENTS))
    if unknown:
        raise InvalidInput(f"unknown event type {unknown[0]!r}; known: {', '.join(ALL_EVENTS)}", field="events")
    return [e for e in ALL_EVENTS if e in events]


def _audit(endpoint: Endpoint, action: str, *, actor: Any, now: Any, **details: Any) -> None:
    AuditEntry.objects.create(tenant_id=endpoint.tenant_id, actor=actor if getattr(actor, "pk", None) else None,
                              action=f"webhook.{action}", target_type="webhook", target_id=str(endpoint.public_id),
                              at=now, details={"url": endpoint.url, **details})


def register(*, tenant: Tenant, actor: Any, url: str, events: Any, owner: Any = None, description: str = "",
             enabled: bool = True) -> tuple[Endpoint, str]:
    """A new endpoint and its secret (the only time the secret is handed out)."""
    url = destinations.validate_url(url)
    events = clean_events(events)
    now = clock.now()
    secret = signing.new_secret()
    with transaction.atomic():
        # Locking the tenant row serializes registrations, so the cap holds under concurrency.
        Tenant.objects.select_for_update().filter(pk=tenant.pk).first()
        if Endpoint.objects.filter(tenant=tenant).count() >= settings.LONGHAUL_WEBHOOK_MAX_ENDPOINTS:
            raise Conflict(f"the tenant already has {settings.LONGHAUL_WEBHOOK_MAX_ENDPOINTS} webhook endpoints, "
                           "the most it may have", code="too_many_webhooks")
        endpoint = Endpoint.objects.create(tenant=tenant, owner=owner, created_by=actor, url=url, events=events,
                                           description=description, enabled=enabled, secret=secret, created_at=now)
        _audit(endpoint, "registered", actor=actor, now=now, events=events)
    return endpoint, secret


def change(endpoint: Endpoint, *, actor: Any, events: Any = None, enabled: bool | None = None,
           description: str | None = None) -> Endpoint:
    """Change what the endpoint hears and whether it is on; enabling it again sends what waited."""
    fields: dict[str, Any] = {}
    if events is not None:
        fields["events"] = clean_events(events)
    if enabled is not None:
        fields["enabled"] = enabled
    if description is not None:
        fields["description"] = description
    if not fields:
        return endpoint
    now = clock.now()
    with transaction.atomic():
        Endpoint.objects.filter(pk=endpoint.pk).update(**fields)
        endpoint.refresh_from_db()
        _audit(endpoint, "changed", actor=actor, now=now, **fields)
        if enabled:
            outbox.kick_waiting(endpoint)
    return endpoint


def rotate(endpoint: Endpoint, *, actor: Any) -> str:
    """A new secret, handed out once; the old one keeps signing through the overlap."""
    now = clock.now()
    with transaction.atomic():
        secret = outbox.rotate_secret(endpoint, now=now)
        if secret is None:
            raise Conflict("the secret was rotated by someone else just now; try again", code="conflict")
        _audit(endpoint, "secret_rotated", actor=actor, now=now,
               overlap_seconds=settings.LONGHAUL_WEBHOOK_SECRET_OVERLAP_SECONDS)
    endpoint.refresh_from_db()
    return secret


def remove(endpoint: Endpoint, *, actor: Any) -> None:
    """Delete the endpoint and its deliveries; a delivery in flight finds its row gone and records nothing."""
    now = clock.now()
    with transaction.atomic():
        _audit(endpoint, "removed", actor=actor, now=now)
        endpoint.delete()
