"""Mounted at api/webhooks by project/urls.py: the list there, one endpoint's routes below it."""

from django.urls import include, path

from webhooks import api

endpoint_patterns = [
    path("<str:endpoint_id>", api.WebhookDetail.as_view(), name="webhook-detail"),
    path("<str:endpoint_id>/rotate-secret", api.WebhookRotateSecret.as_view(), name="webhook-rotate-secret"),
    path("<str:endpoint_id>/deliveries", api.WebhookDeliveries.as_view(), name="webhook-deliveries"),
]

urlpatterns = [
    path("", api.WebhookListCreate.as_view(), name="webhook-list"),
    path("/", include(endpoint_patterns)),
]
