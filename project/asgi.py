"""The web process: HTTP through Django, WebSockets through Channels (served by daphne)."""

import gc
import os
from importlib import import_module

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")

from channels.auth import AuthMiddlewareStack  # noqa: E402
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from channels.security.websocket import AllowedHostsOriginValidator  # noqa: E402
from django.conf import settings  # noqa: E402
from django.core.asgi import get_asgi_application  # noqa: E402
from django.urls import path  # noqa: E402

django_asgi_app = get_asgi_application()

from chat.consumers import ThreadStreamConsumer  # noqa: E402  (these need the apps loaded)
from project.ws_auth import TokenAuthMiddleware  # noqa: E402
from tasks.consumers import TaskStreamConsumer  # noqa: E402

websocket_urlpatterns = [
    path("ws/tasks/<uuid:task_id>/", TaskStreamConsumer.as_asgi()),
    path("ws/threads/<uuid:thread_id>/", ThreadStreamConsumer.as_asgi()),
]

application = ProtocolTypeRouter(
    {
        "http": django_asgi_app,
        # Inside the session stack: a session's user is resolved first, then a token's, for non-browser clients.
        "websocket": AllowedHostsOriginValidator(
            AuthMiddlewareStack(TokenAuthMiddleware(URLRouter(websocket_urlpatterns)))),
    }
)

# Every view and what it imports, now rather than at the first request, so that they are frozen below too.
import_module(settings.ROOT_URLCONF)

# What start-up loaded (Django, the apps, their modules) lives as long as the process: out of the collector's
# sight, a full collection no longer walks it, which held every socket of the process for 170-190 ms.
gc.freeze()
