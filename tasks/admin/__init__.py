"""The operators' admin: tasks and what they did, dead letters, alerts, tenant quotas, the audit log.

Runtime rows are read-only here: they change only through the runtime's one door
(tasks.actions), which the admin actions call, each leaving an AuditEntry that names the
acting admin. A staff user sees and acts only within the tenants where they are a
Membership admin; a superuser sees everything (scoping.py).

    scoping.py   which tenants an operator sees; the tenant-scoped and read-only bases
    outcomes.py  what an action did to the selected rows, said in one sentence
    display.py   how times, durations, JSON and admin links are shown
    tasks.py     the task list (with its dead-letter and trouble views) and its actions
    history.py   what a task left behind: its events, checkpoints and operations
    audit.py     the audit log
    alerts.py    alerts, and the open ones shown on the admin index
    tenants.py   tenants with their quotas and task counts
    tokens.py    API tokens, by the tenants of their users
    pools.py     gateway pools: limits, load and pauses (superusers)
    admissions.py  admission records, as replay_schedule reads them

Django's autodiscovery imports this package; importing the modules registers their admins.
"""

from __future__ import annotations

from django.contrib import admin

from tasks.admin import admissions, alerts, audit, history, pools, tasks, tenants, tokens  # noqa: F401  (each registers its admins)

alerts.show_open_alerts_on_index(admin.site)
