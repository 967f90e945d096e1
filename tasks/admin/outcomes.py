"""What an admin action did to the selected rows, in one sentence."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from django.contrib import messages
from django.db.models import QuerySet
from django.http import HttpRequest

from tasks.admin.scoping import TenantScopedAdmin
from tasks.errors import Conflict, LonghaulError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Phrase:
    one: str
    many: str
    done: bool = False  # the row was changed as asked


COMMON_PHRASES = {
    "not_permitted": Phrase("{n} {noun} is outside your tenants", "{n} {noun} are outside your tenants"),
    "changed": Phrase("{n} {noun} changed meanwhile; try again", "{n} {noun} changed meanwhile; try again"),
    "error": Phrase("{n} {noun} could not be changed (see the log)", "{n} {noun} could not be changed (see the log)"),
}


@dataclass
class OutcomeTally:
    """Counts what an action did to each row: "3 tasks cancelled, 1 task was already finished"."""

    noun: tuple[str, str]
    phrases: dict[str, Phrase]
    counts: Counter[str] = field(default_factory=Counter)

    def add(self, outcome: str) -> None:
        self.counts[outcome] += 1

    def _phrase(self, outcome: str) -> Phrase:
        fallback = Phrase(f"{{n}} {{noun}} not changed ({outcome})", f"{{n}} {{noun}} not changed ({outcome})")
        return self.phrases.get(outcome) or COMMON_PHRASES.get(outcome) or fallback

    def sentence(self) -> str:
        if not self.counts:
            return f"No {self.noun[1]} were changed."
        known = [*self.phrases, *COMMON_PHRASES]
        ordered = sorted(self.counts, key=lambda o: known.index(o) if o in known else len(known))
        parts = []
        for outcome in ordered:
            n = self.counts[outcome]
            phrase = self._phrase(outcome)
            parts.append((phrase.one if n == 1 else phrase.many).format(n=n, noun=self.noun[0 if n == 1 else 1]))
        return ", ".join(parts) + "."

    def level(self) -> int:
        return messages.SUCCESS if any(self._phrase(o).done for o in self.counts) else messages.WARNING


def run_for_each(model_admin: TenantScopedAdmin, request: HttpRequest, queryset: QuerySet,
                 call: Callable[[Any], str], tally: OutcomeTally) -> None:
    """Apply `call` to each selected row the user may operate, tally the outcomes and say them.

    One row's refusal (Conflict) or lost race does not stop the others.
    """
    for obj in queryset.order_by("pk"):
        if not model_admin.has_operate_permission(request, obj):
            tally.add("not_permitted")
            continue
        try:
            tally.add(call(obj))
        except Conflict as exc:
            tally.add(exc.code)
        except LonghaulError:
            log.warning("admin action on %s %s failed", model_admin.opts.model_name, obj.pk, exc_info=True)
            tally.add("error")
    model_admin.message_user(request, tally.sentence(), tally.level())
