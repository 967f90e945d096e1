"""Key rotation while the system runs (DESIGN §14): re-wrapping data keys under a new master key, and
resealing one tenant's content under a new data key.

Resealing walks every model with sealed columns (tasks/sealed.py) in primary-key order, a batch per
transaction with its rows locked, and saves each row's sealed columns again: a save seals with the
tenant's newest key, so a row written meanwhile by the runtime is either resealed after its write or
written sealed under the new key already. Rows written before encryption was on are sealed on the way.
A row whose content fails its integrity check is reported by name and left as it is.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterator

from django.apps import apps
from django.conf import settings
from django.db import models, transaction

from tasks import crypto
from tasks.errors import TamperedContent
from tasks.sealed import SealedFieldMixin, sealed_fields


def sealed_models() -> Iterator[tuple[type[models.Model], tuple[SealedFieldMixin, ...]]]:
    for model in apps.get_models():
        fields = sealed_fields(model)
        if fields:
            yield model, fields


def reseal_tenant(tenant_id: int, *, batch: int = 500,
                  progress: Callable[[str], None] = lambda line: None) -> tuple[int, Counter[str]]:
    """A new data key for the tenant, and every row of its content sealed under it. Returns the new
    version and, per table, the rows resealed (and "<table> tampered" for rows that failed their check)."""
    version = crypto.new_key(tenant_id)
    # Other processes seal with the version they cached for up to this long: the walk starts after it, so
    # a row they write behind it is already sealed under the new version.
    wait = settings.LONGHAUL_KEY_CACHE_SECONDS
    if wait:
        progress(f"key v{version} made; waiting {wait:g} s for every process to take it up")
        time.sleep(wait)
    counts: Counter[str] = Counter()
    for model, fields in sealed_models():
        names = [f.attname for f in fields]
        path = fields[0].tenant_path
        table = model._meta.db_table
        after = 0
        while True:
            with transaction.atomic():
                ids = list(model._base_manager.filter(**{path: tenant_id}, pk__gt=after).order_by("pk")
                           .values_list("pk", flat=True)[:batch])
                if not ids:
                    break
                for pk in ids:
                    try:
                        row = model._base_manager.select_for_update().filter(pk=pk).first()
                    except TamperedContent as exc:
                        counts[f"{table} tampered"] += 1
                        progress(f"{table} {pk}: {exc}")
                        continue
                    if row is not None:
                        row.save(update_fields=names)
                        counts[table] += 1
                after = ids[-1]
            progress(f"{table}: {counts[table]} rows resealed")
    return version, counts
