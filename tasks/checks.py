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


@checks.register()
def pools_named(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """Each pool LONGHAUL_POOLS names is one calls can take: a typo ("tool:serch") would leave its limit
    unused while the real pool runs on the defaults."""
    from django.conf import settings

    from tasks import pools
    from tasks.mcp import config

    try:
        servers = set(config.servers()) if settings.LONGHAUL_MCP_SERVERS else set()
    except ImproperlyConfigured:
        servers = set()  # mcp_servers_file says why
    known = {pools.key_of("model", "", None), *(f"tool:{name}" for name in pools.TOOLS),
             *(f"mcp:{name}" for name in servers)}
    return [checks.Warning(f"LONGHAUL_POOLS names {key!r}, which no call takes: its limits are unused",
                           hint=f"Pools now: {', '.join(sorted(known))}.", id="longhaul.W001")
            for key in sorted(set(settings.LONGHAUL_POOLS) - known)]
