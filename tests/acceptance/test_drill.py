"""The fault drill, short: real workers and daphne under a mixed load, with workers killed and
drained, PostgreSQL restarted (where this test may), kicks duplicated, model and tool calls
failing, and stream clients dropping; afterwards every invariant holds (tests/drill/)."""

from __future__ import annotations

import os
import warnings

import pytest
import redis

from tasks.models import Tenant
from tests.drill.harness import REDIS_URL, Drill, DrillConfig, create_drill_user

# alone: it restarts PostgreSQL, which would cut every other test process's connections.
pytestmark = [pytest.mark.acceptance, pytest.mark.alone, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def redis_available() -> None:
    try:
        redis.Redis.from_url(REDIS_URL, socket_connect_timeout=1).ping()
    except redis.RedisError as exc:
        pytest.skip(f"Redis does not answer at {REDIS_URL} ({exc}); bin/ensure-redis starts one")


def test_a_short_drill_breaks_no_invariant(log_dir, redis_available):
    tenant = Tenant.objects.create(slug="drill", name="Drill", max_running=8, max_queued=500)
    user, token = create_drill_user(tenant, "dana")
    drill = Drill(DrillConfig.short(log_dir), tenant_id=tenant.pk, user=user, token=token)
    report = drill.run()
    print("\n" + report.describe())
    if os.environ.get("LONGHAUL_DRILL_PG_RESTART") == "1" and not drill.postgres.available:
        warnings.warn(f"the drill could not restart PostgreSQL: {drill.postgres.refusal}", stacklevel=1)
    assert not report.violations, report.describe()
    # A drill whose faults did not happen proves nothing.
    assert report.faults["kill9"] >= 1, report.describe()
    assert report.faults["sigterm_drain"] == 1, report.describe()
    assert report.faults["pointless_kicks"] > 0 and report.faults["ws_reconnects"] > 0, report.describe()
    if drill.postgres.available:
        assert report.faults["pg_restart"] == 1, report.describe()
