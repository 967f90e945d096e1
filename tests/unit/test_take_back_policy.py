"""When the weights say a waiting tenant is owed one of another's running slots (admission_policy)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime

import pytest

from tasks.admission_policy import Head, Holding, owes_a_slot, slot_to_take_back

NOW = datetime(2026, 12, 1, tzinfo=UTC)


@dataclass
class Waiting:
    tenant_id: int
    weight: int
    running: int
    max_running: int = 10

    def head(self, *, now: datetime, aging_seconds: float) -> Head | None:
        return Head(id=self.tenant_id, priority=0, queued_at=NOW)


@pytest.mark.parametrize(("giver", "taker", "owed"), [
    ((1, 4), (1, 0), True),    # equal weights, 4 to 0: the move leaves 3 to 1
    ((1, 3), (1, 1), True),    # 3 to 1 becomes 2 to 2
    ((1, 2), (1, 2), False),   # already equal: a move would only swap who is richer
    ((1, 2), (1, 1), False),   # 2 to 1 would become 1 to 2: no better
    ((3, 3), (1, 1), False),   # weights 3 and 1: 3 to 1 is the share
    ((3, 4), (1, 0), True),    # ... and 4 to 0 is not
    ((0, 1), (1, 5), True),    # weight 0 is leftovers only: it gives its last slot
    ((1, 4), (0, 0), False),   # and is never owed one
    ((1, 0), (1, 0), False),   # nothing to give
])
def test_a_slot_is_owed_when_the_move_leaves_the_taker_no_richer_than_the_giver(giver, taker, owed):
    assert owes_a_slot(Holding(tenant_id=1, weight=giver[0], running=giver[1]),
                       Waiting(tenant_id=2, weight=taker[0], running=taker[1])) is owed


def test_the_richest_other_tenants_give_first_and_a_tenant_never_gives_to_itself():
    holders = [Holding(1, 1, 2), Holding(2, 1, 5), Holding(3, 0, 1), Holding(5, 1, 1)]
    taker, givers = slot_to_take_back([Waiting(4, 1, 0)], holders, now=NOW, aging_seconds=60)
    assert taker.tenant_id == 4
    assert [g.tenant_id for g in givers] == [3, 2, 1], "weight 0 first; a tenant with 1 slot owes none"
    assert slot_to_take_back([Waiting(2, 1, 5)], [Holding(2, 1, 5)], now=NOW, aging_seconds=60) is None
