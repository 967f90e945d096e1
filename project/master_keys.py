"""The master keys that wrap each tenant's data key (tasks/crypto.py), read from the environment before the
apps load.

`LONGHAUL_MASTER_KEYS` is a comma-separated list of `id:base64key` pairs, each key 32 bytes (AES-256); the
first is current (it wraps new and re-wrapped data keys), the others stay to unwrap what they wrapped until
`manage.py rotate_master_key` has re-wrapped it. With DEBUG=1 and no variable, one key is generated on first
start and kept in var/master_keys, as the secret key is; without DEBUG a missing or malformed variable stops
the process at start, naming it.
"""

from __future__ import annotations

import base64
import binascii
import re
import secrets
from pathlib import Path

from django.core.exceptions import ImproperlyConfigured

VARIABLE = "LONGHAUL_MASTER_KEYS"
KEY_BYTES = 32
KEY_ID = re.compile(r"^[A-Za-z0-9_.-]{1,32}$")


def parse(raw: str) -> dict[str, bytes]:
    """`id:base64key,...` as {id: key}, in order (the first is current)."""
    keys: dict[str, bytes] = {}
    for n, pair in enumerate((p.strip() for p in raw.split(",")), start=1):
        key_id, sep, encoded = pair.partition(":")
        if not sep or not KEY_ID.match(key_id):
            raise ImproperlyConfigured(f"{VARIABLE}: entry {n} must be id:base64key, the id 1 to 32 letters, "
                                       "digits, '.', '_' or '-'")
        try:
            key = base64.b64decode(encoded.strip(), validate=True)
        except (binascii.Error, ValueError):
            raise ImproperlyConfigured(f"{VARIABLE}: the key of {key_id!r} is not valid base64") from None
        if len(key) != KEY_BYTES:
            raise ImproperlyConfigured(f"{VARIABLE}: the key of {key_id!r} is {len(key)} bytes; it must be "
                                       f"{KEY_BYTES} (AES-256)")
        if key_id in keys:
            raise ImproperlyConfigured(f"{VARIABLE}: the id {key_id!r} is listed twice")
        keys[key_id] = key
    return keys


def load(raw: str, *, debug: bool, var_dir: Path) -> dict[str, bytes]:
    if raw.strip():
        return parse(raw)
    if not debug:
        raise ImproperlyConfigured(f"{VARIABLE} must be set (id:base64key, 32 bytes; e.g. "
                                   f"k1:$(openssl rand -base64 32)); on a development machine set DEBUG=1 instead, "
                                   "which keeps a generated key in var/")
    path = var_dir / "master_keys"
    if not path.exists():
        var_dir.mkdir(parents=True, exist_ok=True)
        path.write_text(f"k1:{base64.b64encode(secrets.token_bytes(KEY_BYTES)).decode()}\n")
        path.chmod(0o600)
    return parse(path.read_text().strip())


def generate(key_id: str) -> str:
    """A new entry for the variable, to put first."""
    return f"{key_id}:{base64.b64encode(secrets.token_bytes(KEY_BYTES)).decode()}"
