"""The retention settings' names, defaults and rule, readable before the apps load (settings.py uses them;
tasks/retention.py does the purging)."""

from __future__ import annotations

from collections.abc import Callable

from django.core.exceptions import ImproperlyConfigured

# Days each data class is kept (0: for ever); tasks' data counts from the task's end.
# admissions: the admission records (tasks/admission_records.py) the scheduling replay reads, counted from
# their arrival; like every class they are outlived by audit entries (check below).
DEFAULT_DAYS = {"events": 90, "checkpoints": 7, "operation_payloads": 30, "results": 0, "messages": 0, "audit": 0,
                "admissions": 90}
MAX_DAYS = 100 * 365


def setting_name(data_class: str) -> str:
    return f"LONGHAUL_RETENTION_{data_class.upper()}_DAYS"


def check(values: dict[str, int], *, name: Callable[[str], str] = setting_name) -> None:
    """Audit entries outlive what they describe: their retention is 0 (for ever) or at least every other's.
    `name` says a class as the caller's reader knows it (a setting; a field of the admin's form)."""
    audit = values["audit"]
    if audit == 0:
        return
    for data_class, kept in values.items():
        if data_class != "audit" and (kept == 0 or kept > audit):
            raise ImproperlyConfigured(
                f"{name('audit')} must be 0 or at least {name(data_class)} "
                f"({'0, kept for ever' if kept == 0 else kept}): audit entries outlive what they describe")
