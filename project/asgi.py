"""The web process: HTTP through Django, WebSockets through Channels (served by daphne)."""

import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")

from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from channels.security.websocket import AllowedHostsOriginValidator  # noqa: E402
from channels.auth import AuthMiddlewareStack  # noqa: E402
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
