"""System checks: configuration mistakes reported at start-up (`manage.py check`, runserver, qcluster)."""

from __future__ import annotations

from typing import Any

from django.core import checks
from django.core.exceptions import ImproperlyConfigured


@checks.register()
def mcp_servers_file(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """The MCP servers file parses and every variable it names is set (else the first mcp task would 500)."""
    from django.conf import settings

    from tasks.mcp import config

    if not settings.LONGHAUL_MCP_SERVERS:
        return []
    try:
        config.read(settings.LONGHAUL_MCP_SERVERS)
    except ImproperlyConfigured as exc:
        return [checks.Error(str(exc), hint="See README, 'Remote MCP tools as background tasks'.",
                             id="longhaul.E001")]
    return []
