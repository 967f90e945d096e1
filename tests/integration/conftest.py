"""Fixtures the integration tests share."""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
import pytest
from django.db import connection


@pytest.fixture
def other_session() -> Iterator[psycopg.Connection]:
    """A second database session, as another worker process's gateway job would have."""
    s = connection.settings_dict
    with psycopg.connect(host=s["HOST"] or "127.0.0.1", port=s["PORT"] or 5432, user=s["USER"],
                         password=s["PASSWORD"] or None, dbname=s["NAME"], autocommit=True) as session:
        yield session
