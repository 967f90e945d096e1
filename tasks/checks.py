"""System checks: configuration mistakes reported at start-up (`manage.py check`, runserver, qcluster)."""

from __future__ import annotations

from collections.abc import Iterator
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


@checks.register()
def gateway_turns(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """No more gateway turns than worker processes to hold them: a process holds one at a time, and while a turn
    is free every step asking for calls kicks a job that takes it, so a turn no process can take means a kick
    per step, each running a job that starts nothing."""
    from django.conf import settings

    if settings.LONGHAUL_GATEWAY_TURNS <= settings.LONGHAUL_STEP_WORKERS:
        return []
    return [checks.Warning(
        f"LONGHAUL_GATEWAY_TURNS is {settings.LONGHAUL_GATEWAY_TURNS}, above the {settings.LONGHAUL_STEP_WORKERS} "
        "worker processes (LONGHAUL_STEP_WORKERS) that could hold them: the turns left free make every step asking "
        "for calls kick a gateway job that starts nothing",
        hint="Set LONGHAUL_GATEWAY_TURNS to at most the worker processes of every machine.", id="longhaul.W003")]


@checks.register(checks.Tags.database)
def autovacuum_runs(app_configs: Any = None, databases: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """PostgreSQL's autovacuum runs on the tables the hot path rewrites. Without it their dead rows stay and
    their statistics keep describing the tables as they were: the claim of the task due longest is then planned
    as for an empty table, a bitmap scan of every due row and of every dead index entry the steps left.
    A database check: `manage.py migrate` and `manage.py check --database default` run it."""
    from django_q.models import OrmQ

    from tasks.models import Checkpoint, Operation, Task, TaskEvent

    # The tables every step, call and kick writes. Each UPDATE of theirs leaves a dead row and dead index entries
    # (the task row's updates are never HOT: tasks/models.py), and the claim is planned from their statistics.
    rewritten = [model._meta.db_table for model in (Task, TaskEvent, Checkpoint, Operation, OrmQ)]
    found: list[checks.CheckMessage] = []
    for alias, cursor in _postgresql_cursors(databases):
        cursor.execute("SELECT current_setting('autovacuum') = 'on'")
        server_on = cursor.fetchone()[0]
        # The option as set (false, off, no, 0...), read as a boolean.
        cursor.execute("SELECT relname FROM pg_class WHERE relname = ANY(%s) AND relkind = 'r' "
                       "AND pg_table_is_visible(oid) AND EXISTS (SELECT 1 FROM pg_options_to_table(reloptions) "
                       "WHERE option_name = 'autovacuum_enabled' AND NOT option_value::bool) "
                       "ORDER BY relname", [rewritten])
        tables_off = [name for (name,) in cursor.fetchall()]
        off = rewritten if not server_on else tables_off
        why = "the server's autovacuum is off" if not server_on else "autovacuum_enabled=false"
        if off:
            found.append(checks.Warning(
                f"autovacuum does not run on {', '.join(off)} (database {alias!r}: {why}): their dead rows stay "
                "and their statistics go stale, and each claim of a due task slows as they grow",
                hint=f"Turn it on; where it must stay off, run VACUUM (ANALYZE) on {', '.join(off)} every few "
                     "minutes while tasks run.", id="longhaul.W002"))
    return found


@checks.register(checks.Tags.database)
def broker_table_vacuumed(app_configs: Any = None, databases: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """The workers' database role may vacuum the broker's table, which their monitors do every VACUUM_EVERY
    messages (tasks/broker.py): it turns its rows over far faster than autovacuum passes. A database check."""
    from django_q.models import OrmQ

    from tasks import broker

    found: list[checks.CheckMessage] = []
    for alias, cursor in _postgresql_cursors(databases):
        if broker.may_vacuum(cursor, OrmQ._meta.db_table) is not False:
            continue  # it may, or the table is not there yet (the check runs before the migrations)
        found.append(checks.Warning(
            f"the database role of {alias!r} may not vacuum {OrmQ._meta.db_table}: under a steady load its dead "
            "rows pile up between autovacuum's passes, and every claim of a due task reads them",
            hint=f"Run the workers as the role that owns {OrmQ._meta.db_table} (the one that ran the migrations), "
                 "or make their role a member of it.", id="longhaul.W004"))
    return found


def _postgresql_cursors(databases: Any) -> Iterator[tuple[str, Any]]:
    """A cursor on each PostgreSQL database a database check was asked to read (none unless asked)."""
    from django.db import connections

    for alias in databases or ():
        connection = connections[alias]
        if connection.vendor == "postgresql":
            with connection.cursor() as cursor:
                yield alias, cursor
