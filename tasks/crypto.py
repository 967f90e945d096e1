"""Content at rest (DESIGN §14): sealed with a per-tenant data key, AES-256-GCM.

Each tenant has data keys in versions (TenantKey), each wrapped by a master key from
LONGHAUL_MASTER_KEYS (project/master_keys.py). Sealing uses the tenant's newest key; a token says
which tenant and version sealed it, so older versions keep opening what they sealed while
`rotate_tenant_key` reseals it. A token is

    lh1:<tenant id>:<key version>:<base64 of nonce and ciphertext>

and the GCM tag covers the column and the tenant as associated data, so a token tampered with, or
copied into another column or tenant, fails to open: `TamperedContent`, never a wrong value.
Destroying a tenant's keys (crypto-shredding) keeps their rows without the keys: what they sealed
opens as `ERASED`, a clear "content erased", and new content gets a new key.

Which columns are sealed, and how writes find their tenant, is tasks/sealed.py.
"""

from __future__ import annotations

import base64
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import Max

from tasks import clock
from tasks.errors import LonghaulError, TamperedContent
from tasks.models import TenantKey

MARK = "lh1"
NONCE_BYTES = 12
ERASED = object()  # what open_token gives for content whose key was destroyed


class KeyUnavailable(LonghaulError):
    """A data key cannot be unwrapped: its master key is not in LONGHAUL_MASTER_KEYS."""


def enabled() -> bool:
    return bool(settings.LONGHAUL_ENCRYPT_AT_REST)


def is_token(value: Any) -> bool:
    return isinstance(value, str) and value.startswith(f"{MARK}:")


def seal(tenant_id: int, plaintext: bytes, *, label: str) -> str:
    version, key = current_key(tenant_id)
    nonce = os.urandom(NONCE_BYTES)
    sealed = AESGCM(key).encrypt(nonce, plaintext, _aad(label, tenant_id))
    return f"{MARK}:{tenant_id}:{version}:{base64.b64encode(nonce + sealed).decode()}"


def open_token(token: str, *, label: str) -> tuple[int, bytes | object]:
    """The tenant that sealed a token, and its plaintext (ERASED if the key was destroyed)."""
    tenant_id, version, body = parse(token, label=label)
    key = data_key(tenant_id, version)
    if key is None:
        return tenant_id, ERASED
    try:
        return tenant_id, AESGCM(key).decrypt(body[:NONCE_BYTES], body[NONCE_BYTES:], _aad(label, tenant_id))
    except InvalidTag:
        raise TamperedContent(f"{label}: sealed content failed its integrity check (tenant {tenant_id}, "
                              f"key v{version}); it was changed or moved, and is not shown") from None


def parse(token: str, *, label: str) -> tuple[int, int, bytes]:
    try:
        mark, tenant, version, encoded = token.split(":", 3)
        body = base64.b64decode(encoded, validate=True)
        if mark != MARK or len(body) <= NONCE_BYTES:
            raise ValueError(mark)
        return int(tenant), int(version), body
    except ValueError:
        raise TamperedContent(f"{label}: a sealed value is malformed; it was changed, and is not shown") from None


def _aad(label: str, tenant_id: int) -> bytes:
    return f"{label}|{tenant_id}".encode()


# --- data keys ---------------------------------------------------------------------------------------

# (tenant, version) -> (key, or None once destroyed; when read). tenant -> (current version, when read).
_keys: dict[tuple[int, int], tuple[bytes | None, float]] = {}
_current: dict[int, tuple[int, float]] = {}


class _Writing(threading.local):
    """Per thread (a connection's): the tenants whose key rows its open transaction has written (made or destroyed)."""

    def __init__(self) -> None:
        self.tenants: set[int] = set()


_writing = _Writing()


def forget_cached_keys() -> None:
    _keys.clear()
    _current.clear()


def _fresh(read_at: float) -> bool:
    return time.monotonic() - read_at < settings.LONGHAUL_KEY_CACHE_SECONDS


def current_key(tenant_id: int) -> tuple[int, bytes]:
    """The tenant's newest live key (created on first use), as (version, key)."""
    cached = _current.get(tenant_id)
    if cached and _fresh(cached[1]):
        key = data_key(tenant_id, cached[0])
        if key is not None:
            return cached[0], key
    row = TenantKey.objects.filter(tenant_id=tenant_id, destroyed_at__isnull=True).order_by("-version").first()
    if row is None:
        row = _new_key(tenant_id)
    key = _unwrap(row)
    _remember(tenant_id, row.version, key, current=True)
    return row.version, key


def data_key(tenant_id: int, version: int) -> bytes | None:
    """The key of that version, or None once destroyed."""
    cached = _keys.get((tenant_id, version))
    if cached and _fresh(cached[1]):
        return cached[0]
    row = TenantKey.objects.filter(tenant_id=tenant_id, version=version).first()
    if row is None:  # a destroyed key keeps its row: no row means the token was never sealed here
        raise TamperedContent(f"no data key v{version} of tenant {tenant_id} exists; the sealed value was not "
                              "written by this installation, or its key row was deleted")
    key = None if row.destroyed_at else _unwrap(row)
    _remember(tenant_id, version, key)
    return key


def _remember(tenant_id: int, version: int, key: bytes | None, *, current: bool = False) -> None:
    """Cache a key as read. A key row this thread's open transaction wrote (made or destroyed) is cached once it
    commits: one made in a transaction that rolls back must not outlive it here, or content sealed with it later
    would point at a version that does not exist (nor a destroyed key hide a live one). Any other row it read was
    committed before, and is cached at once: a transaction that seals or opens many values (a batch of
    outcomes) reads the key once, not once a value."""
    def store() -> None:
        _keys[(tenant_id, version)] = (key, time.monotonic())
        if current:
            _current[tenant_id] = (version, time.monotonic())
        _writing.tenants.discard(tenant_id)  # what this thread reads of them now is committed (a rollback left it)

    if tenant_id in _writing.tenants:
        transaction.on_commit(store)
    else:
        store()


def _writes_keys_of(tenant_id: int) -> None:
    """Before this thread writes the tenant's key rows: until its transaction commits, what it reads of them
    is not cached (the commit, or the next cached read after a rollback, clears the mark)."""
    if transaction.get_connection().in_atomic_block:
        written = _writing.tenants
        written.add(tenant_id)
        transaction.on_commit(lambda: written.discard(tenant_id))


def new_key(tenant_id: int) -> int:
    """A new current version for the tenant (rotate_tenant_key); returns it."""
    row = _new_key(tenant_id)
    _current.pop(tenant_id, None)
    return row.version


def _new_key(tenant_id: int) -> TenantKey:
    newest = TenantKey.objects.filter(tenant_id=tenant_id).aggregate(v=Max("version"))["v"] or 0
    key = AESGCM.generate_key(bit_length=256)
    master_id, wrapped = _wrap(key, tenant_id, newest + 1)
    try:
        with transaction.atomic():
            _writes_keys_of(tenant_id)
            return TenantKey.objects.create(tenant_id=tenant_id, version=newest + 1, master_key_id=master_id,
                                            wrapped=wrapped, created_at=clock.now())
    except IntegrityError:  # another process made this version first: use the one it made
        return TenantKey.objects.get(tenant_id=tenant_id, version=newest + 1)


def destroy_keys(tenant_id: int) -> int:
    """Crypto-shredding: every version of the tenant's key is gone; returns how many were destroyed."""
    _writes_keys_of(tenant_id)
    destroyed = TenantKey.objects.filter(tenant_id=tenant_id, destroyed_at__isnull=True).update(
        wrapped=b"", destroyed_at=clock.now())
    for version in [v for (t, v) in _keys if t == tenant_id]:
        _keys.pop((tenant_id, version), None)
    _current.pop(tenant_id, None)
    return destroyed


# --- master keys -------------------------------------------------------------------------------------


def _master(key_id: str) -> bytes:
    try:
        return settings.LONGHAUL_MASTER_KEYS[key_id]
    except KeyError:
        raise KeyUnavailable(f"master key {key_id!r} is not in LONGHAUL_MASTER_KEYS; add it back (after the "
                             "current one) until rotate_master_key has re-wrapped what it wrapped") from None


def current_master_id() -> str:
    return next(iter(settings.LONGHAUL_MASTER_KEYS))


def _wrap(key: bytes, tenant_id: int, version: int) -> tuple[str, bytes]:
    master_id = current_master_id()
    nonce = os.urandom(NONCE_BYTES)
    return master_id, nonce + AESGCM(_master(master_id)).encrypt(nonce, key, f"tenant:{tenant_id}:v{version}".encode())


def _unwrap(row: TenantKey) -> bytes:
    wrapped = bytes(row.wrapped)
    try:
        return AESGCM(_master(row.master_key_id)).decrypt(
            wrapped[:NONCE_BYTES], wrapped[NONCE_BYTES:], f"tenant:{row.tenant_id}:v{row.version}".encode())
    except InvalidTag:
        raise TamperedContent(f"the data key of tenant {row.tenant_id} v{row.version} failed its integrity check "
                              f"under master key {row.master_key_id!r}") from None


def rewrap_all(*, progress: Callable[[str], None] = lambda line: None) -> int:
    """Re-wrap every live data key under the current master key (rotate_master_key); returns how many moved.
    The data keys themselves do not change, so no content is touched."""
    current = current_master_id()
    moved = 0
    for row in TenantKey.objects.filter(destroyed_at__isnull=True).exclude(master_key_id=current).order_by("pk"):
        key = _unwrap(row)
        master_id, wrapped = _wrap(key, row.tenant_id, row.version)
        moved += TenantKey.objects.filter(pk=row.pk, master_key_id=row.master_key_id).update(
            master_key_id=master_id, wrapped=wrapped)
        progress(f"tenant {row.tenant_id} v{row.version}: {row.master_key_id} -> {master_id}")
    return moved
