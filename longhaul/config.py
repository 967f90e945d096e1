"""Where `longhaul login` keeps the server and the token.

The file is $XDG_CONFIG_HOME/longhaul/config.json (~/.config/longhaul/config.json without it),
readable by its owner only (0600, in a 0700 directory): the token is as good as a password.
LONGHAUL_URL, LONGHAUL_TOKEN and LONGHAUL_TENANT win over the file, so scripts and CI need no file.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from longhaul.errors import NotSignedIn

FILE_MODE = 0o600
DIR_MODE = 0o700


@dataclass(frozen=True)
class Login:
    url: str
    token: str
    tenant: str | None = None


def config_path(env: Mapping[str, str] = os.environ) -> Path:
    root = env.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(root) / "longhaul" / "config.json"


def read_file(env: Mapping[str, str] = os.environ) -> dict[str, str]:
    path = config_path(env)
    try:
        stored = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise NotSignedIn(f"cannot read {path} ({exc}); run `longhaul login URL` again") from exc
    return {k: v for k, v in stored.items() if isinstance(v, str)} if isinstance(stored, dict) else {}


def load(env: Mapping[str, str] = os.environ) -> Login:
    """The login to use: the environment's values over the file's."""
    stored = read_file(env)
    url = env.get("LONGHAUL_URL") or stored.get("url")
    token = env.get("LONGHAUL_TOKEN") or stored.get("token")
    tenant = env.get("LONGHAUL_TENANT") or stored.get("tenant") or None
    if not url or not token:
        raise NotSignedIn("not signed in: run `longhaul login URL` (or set LONGHAUL_URL and LONGHAUL_TOKEN)")
    return Login(url=url, token=token, tenant=tenant)


def save(login: Login, env: Mapping[str, str] = os.environ) -> Path:
    """Write the login, owner-only from the first byte (created 0600, then renamed into place)."""
    path = config_path(env)
    path.parent.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
    values = {k: v for k, v in asdict(login).items() if v is not None}
    # mkstemp creates the file 0600: the token is never readable by others, not even for a moment.
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=".config-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as out:
            json.dump(values, out, indent=2)
            out.write("\n")
        os.chmod(temp, FILE_MODE)
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise
    return path


def forget(env: Mapping[str, str] = os.environ) -> bool:
    """Remove the stored login; False when there was none."""
    try:
        config_path(env).unlink()
    except FileNotFoundError:
        return False
    return True
