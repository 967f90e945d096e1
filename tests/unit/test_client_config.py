"""The stored login: where it lives, who may read it, and what the environment overrides."""

from __future__ import annotations

import json
import stat

import pytest

from longhaul import config
from longhaul.errors import NotSignedIn

pytestmark = pytest.mark.smoke


def test_it_keeps_the_login_under_xdg_config_home_readable_by_its_owner_only(tmp_path):
    env = {"XDG_CONFIG_HOME": str(tmp_path / "cfg")}
    path = config.save(config.Login(url="http://h:8000", token="t0k"), env)
    assert path == tmp_path / "cfg" / "longhaul" / "config.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert json.loads(path.read_text()) == {"url": "http://h:8000", "token": "t0k"}
    assert config.load(env) == config.Login(url="http://h:8000", token="t0k")


def test_it_falls_back_to_dot_config_in_home(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert config.config_path({}) == tmp_path / ".config" / "longhaul" / "config.json"


def test_it_replaces_a_login_and_keeps_it_private(tmp_path):
    env = {"XDG_CONFIG_HOME": str(tmp_path)}
    config.save(config.Login(url="http://a", token="1"), env)
    config.config_path(env).chmod(0o644)
    config.save(config.Login(url="http://b", token="2", tenant="acme"), env)
    assert config.load(env) == config.Login(url="http://b", token="2", tenant="acme")
    assert stat.S_IMODE(config.config_path(env).stat().st_mode) == 0o600


def test_it_lets_the_environment_win_over_the_file(tmp_path):
    env = {"XDG_CONFIG_HOME": str(tmp_path)}
    config.save(config.Login(url="http://a", token="1", tenant="acme"), env)
    assert config.load({**env, "LONGHAUL_TOKEN": "2"}) == config.Login(url="http://a", token="2", tenant="acme")
    assert config.load({"XDG_CONFIG_HOME": str(tmp_path / "none"), "LONGHAUL_URL": "http://c",
                        "LONGHAUL_TOKEN": "3"}) == config.Login(url="http://c", token="3")


def test_it_says_how_to_sign_in_when_there_is_no_login(tmp_path):
    with pytest.raises(NotSignedIn, match="longhaul login URL"):
        config.load({"XDG_CONFIG_HOME": str(tmp_path)})


def test_it_forgets_the_login(tmp_path):
    env = {"XDG_CONFIG_HOME": str(tmp_path)}
    config.save(config.Login(url="http://a", token="1"), env)
    assert config.forget(env) is True
    assert config.forget(env) is False
