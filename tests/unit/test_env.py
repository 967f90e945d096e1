"""Settings readers in project/env.py: defaults, parsing, and loud failures that name the variable."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from django.core.exceptions import ImproperlyConfigured

from project.env import database_from_url, envbool, envfloat, envint, envlist

pytestmark = pytest.mark.smoke

ROOT = Path(__file__).resolve().parents[2]


def test_it_returns_the_default_when_a_variable_is_unset(monkeypatch):
    for name in ("LH_BOOL", "LH_INT", "LH_FLOAT", "LH_LIST"):
        monkeypatch.delenv(name, raising=False)
    assert envbool("LH_BOOL", True) is True
    assert envint("LH_INT", 7) == 7
    assert envfloat("LH_FLOAT", 0.5) == 0.5
    assert envlist("LH_LIST", ["a"]) == ["a"]


@pytest.mark.parametrize(("raw", "expected"), [("1", True), ("TRUE", True), (" yes ", True), ("on", True),
                                               ("0", False), ("false", False), ("No", False), ("off", False)])
def test_it_reads_booleans(monkeypatch, raw, expected):
    monkeypatch.setenv("LH_BOOL", raw)
    assert envbool("LH_BOOL", not expected) is expected


def test_it_refuses_a_bad_boolean_naming_the_variable(monkeypatch):
    monkeypatch.setenv("LH_BOOL", "maybe")
    with pytest.raises(ImproperlyConfigured, match="LH_BOOL"):
        envbool("LH_BOOL")


def test_it_reads_integers_and_treats_blank_as_unset(monkeypatch):
    monkeypatch.setenv("LH_INT", "42")
    assert envint("LH_INT", 1) == 42
    monkeypatch.setenv("LH_INT", "  ")
    assert envint("LH_INT", 3) == 3


@pytest.mark.parametrize("raw", ["forty", "1.5", "0x10"])
def test_it_refuses_a_bad_integer_naming_the_variable(monkeypatch, raw):
    monkeypatch.setenv("LH_INT", raw)
    with pytest.raises(ImproperlyConfigured, match="LH_INT"):
        envint("LH_INT", 1)


def test_it_refuses_integers_outside_their_bounds(monkeypatch):
    monkeypatch.setenv("LH_INT", "0")
    with pytest.raises(ImproperlyConfigured, match="LH_INT must be at least 1"):
        envint("LH_INT", 5, minimum=1)
    monkeypatch.setenv("LH_INT", "11")
    with pytest.raises(ImproperlyConfigured, match="LH_INT must be at most 10"):
        envint("LH_INT", 5, maximum=10)


def test_it_reads_floats_and_refuses_bad_ones_naming_the_variable(monkeypatch):
    monkeypatch.setenv("LH_FLOAT", "0.25")
    assert envfloat("LH_FLOAT", 1.0) == 0.25
    monkeypatch.setenv("LH_FLOAT", "fast")
    with pytest.raises(ImproperlyConfigured, match="LH_FLOAT"):
        envfloat("LH_FLOAT", 1.0)
    monkeypatch.setenv("LH_FLOAT", "-1")
    with pytest.raises(ImproperlyConfigured, match="LH_FLOAT must be at least 0"):
        envfloat("LH_FLOAT", 1.0, minimum=0.0)
    monkeypatch.setenv("LH_FLOAT", "1.5")
    with pytest.raises(ImproperlyConfigured, match="LH_FLOAT must be at most 1"):
        envfloat("LH_FLOAT", 0.8, minimum=0.01, maximum=1.0)


@pytest.mark.parametrize("raw", ["nan", "inf", "-inf"])
def test_it_refuses_a_float_that_is_not_finite(monkeypatch, raw):
    """NaN passes every bound (each comparison is false), so it is refused first."""
    monkeypatch.setenv("LH_FLOAT", raw)
    with pytest.raises(ImproperlyConfigured, match="LH_FLOAT must be a finite number"):
        envfloat("LH_FLOAT", 0.8, minimum=0.01, maximum=1.0)


def test_it_splits_lists_on_commas_and_drops_blanks(monkeypatch):
    monkeypatch.setenv("LH_LIST", " a.example, b.example ,, ")
    assert envlist("LH_LIST", []) == ["a.example", "b.example"]
    monkeypatch.setenv("LH_LIST", "")
    assert envlist("LH_LIST", ["default"]) == []


def test_it_configures_sqlite_for_concurrent_writers(tmp_path):
    config = database_from_url("DATABASE_URL", f"sqlite:///{tmp_path / 'db.sqlite3'}")
    assert config["ENGINE"] == "django.db.backends.sqlite3"
    assert config["NAME"] == str(tmp_path / "db.sqlite3")
    assert config["OPTIONS"]["transaction_mode"] == "IMMEDIATE"
    assert "journal_mode=WAL" in config["OPTIONS"]["init_command"]


def test_it_reads_a_postgres_url():
    config = database_from_url("DATABASE_URL", "postgres://u:p@db.internal:6543/longhaul")
    assert config["ENGINE"] == "django.db.backends.postgresql"
    assert (config["HOST"], config["PORT"], config["NAME"], config["USER"]) == ("db.internal", 6543, "longhaul", "u")
    assert "transaction_mode" not in config.get("OPTIONS", {})


@pytest.mark.parametrize("url", ["mysql://u:p@h/db", "oracle://u:p@h/db"])
def test_it_refuses_a_database_other_than_postgres_or_sqlite(url):
    with pytest.raises(ImproperlyConfigured, match="DATABASE_URL must be a postgres:// or sqlite:// URL"):
        database_from_url("DATABASE_URL", url)


def test_it_refuses_a_url_it_cannot_parse_naming_the_variable():
    with pytest.raises(ImproperlyConfigured, match="OTHER_DB_URL"):
        database_from_url("OTHER_DB_URL", "http://not-a-database")


def test_it_refuses_to_start_without_a_secret_key_when_debug_is_off(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "SECRET_KEY"}
    # A fresh var dir, so no generated development key could be picked up instead.
    env.update(DEBUG="0", DJANGO_SETTINGS_MODULE="project.settings", LONGHAUL_VAR_DIR=str(tmp_path))
    result = subprocess.run([sys.executable, "-c", "import django; django.setup()"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert "SECRET_KEY" in result.stderr
