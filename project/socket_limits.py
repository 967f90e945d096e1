"""How many live stream sockets a user, and a tenant, may hold at once.

Each socket takes a slot in two sets, its user's and its tenant's, when it is accepted and
gives them back when it closes; a socket that would exceed either limit
(LONGHAUL_WS_MAX_PER_USER, LONGHAUL_WS_MAX_PER_TENANT) is refused with 4429 and a reason naming
the limit. With REDIS_URL the sets are Redis sorted sets shared by every web process: a slot's
score is when it expires, an open socket pushes that forward every HEARTBEAT_S, and slots past it
are pruned before each count, so a process that dies frees its slots within SLOT_TTL_S. Without
Redis (the embedded, single-process default) the sets live in process memory.

Like the request throttles (project/throttles.py), a Redis outage lets sockets through rather than
closing every stream: the count is a guard against floods, not something a stream depends on.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections import defaultdict
from dataclasses import dataclass
from functools import cache
from typing import Literal, Protocol

from django.conf import settings
from redis.asyncio import Redis
from redis.exceptions import RedisError

log = logging.getLogger(__name__)

# An open socket refreshes its slots this often; a slot not refreshed for SLOT_TTL_S is
# taken to belong to a dead process (three missed beats, so a busy loop does not lose one).
HEARTBEAT_S = 30
SLOT_TTL_S = 3 * HEARTBEAT_S
# What a refused client is told to wait: slots free up when someone closes a tab, which
# nobody can predict; long enough that refused tabs do not hammer the server.
RETRY_AFTER_S = 30
KEY_PREFIX = "longhaul:ws-slots"

Per = Literal["user", "tenant"]


@dataclass(frozen=True)
class Slot:
    """One socket's claim on its user's and its tenant's limits."""

    socket_id: str
    user_id: int
    tenant_id: int

    @property
    def keys(self) -> tuple[str, str]:
        return f"{KEY_PREFIX}:user:{self.user_id}", f"{KEY_PREFIX}:tenant:{self.tenant_id}"


@dataclass(frozen=True)
class Refusal:
    """Which limit refused a socket, and when to try again."""

    per: Per
    limit: int
    retry_after_s: int = RETRY_AFTER_S

    @property
    def reason(self) -> str:
        # A WebSocket close reason is at most 123 bytes.
        return f"at most {self.limit} live streams per {self.per}; close a tab or retry in {self.retry_after_s} s"


def limits() -> tuple[int, int]:
    """(per user, per tenant), read at each connect so tests and settings changes apply."""
    return settings.LONGHAUL_WS_MAX_PER_USER, settings.LONGHAUL_WS_MAX_PER_TENANT


class SocketSlots(Protocol):
    async def acquire(self, slot: Slot) -> Refusal | None:
        """Take the slot, or say which limit is full (and take nothing)."""

    async def refresh(self, slot: Slot) -> None:
        """The socket is still open: keep its slot from expiring."""

    async def release(self, slot: Slot) -> None:
        """The socket closed: free its slot."""


class LocalSlots:
    """Slots in this process's memory: the embedded default, one web process."""

    def __init__(self) -> None:
        self._held: defaultdict[str, set[str]] = defaultdict(set)

    async def acquire(self, slot: Slot) -> Refusal | None:
        refusal = _refusal(*(len(self._held[key]) for key in slot.keys))
        if refusal is None:
            for key in slot.keys:
                self._held[key].add(slot.socket_id)
        return refusal

    async def refresh(self, slot: Slot) -> None:
        pass  # nothing expires: the process that holds the slots is the one that would die

    async def release(self, slot: Slot) -> None:
        for key in slot.keys:
            self._held[key].discard(slot.socket_id)
            if not self._held[key]:
                del self._held[key]


# Count and take in one script, so two processes cannot both take the last slot. The clock is
# Redis's own: web processes' clocks may disagree, and a slot's expiry must not depend on whose it was.
# KEYS: the user's set, the tenant's set. ARGV: socket id, user limit, tenant limit, ttl seconds.
# Returns 0 (taken), 1 (the user's limit is full) or 2 (the tenant's).
ACQUIRE = """
local now = tonumber(redis.call('TIME')[1])
for i = 1, 2 do redis.call('ZREMRANGEBYSCORE', KEYS[i], '-inf', now) end
for i = 1, 2 do
  if redis.call('ZCARD', KEYS[i]) >= tonumber(ARGV[i + 1]) then return i end
end
for i = 1, 2 do
  redis.call('ZADD', KEYS[i], now + tonumber(ARGV[4]), ARGV[1])
  redis.call('EXPIRE', KEYS[i], tonumber(ARGV[4]))
end
return 0
"""
# Re-adds a slot pruned while its process was stalled: a limit may then be exceeded by that socket.
REFRESH = """
local now = tonumber(redis.call('TIME')[1])
for i = 1, 2 do
  redis.call('ZADD', KEYS[i], now + tonumber(ARGV[2]), ARGV[1])
  redis.call('EXPIRE', KEYS[i], tonumber(ARGV[2]))
end
"""


class RedisSlots:
    """Slots in Redis, shared by every web process."""

    def __init__(self, url: str) -> None:
        self.url = url
        # redis.asyncio clients belong to the event loop that made them.
        self._clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Redis] = weakref.WeakKeyDictionary()

    def _client(self) -> Redis:
        loop = asyncio.get_running_loop()
        client = self._clients.get(loop)
        if client is None:
            # Short timeouts: a Redis outage must not hold up every connect (see the module docstring).
            client = Redis.from_url(self.url, socket_connect_timeout=1, socket_timeout=1)
            self._clients[loop] = client
        return client

    async def acquire(self, slot: Slot) -> Refusal | None:
        user_limit, tenant_limit = limits()
        try:
            full = await self._client().eval(
                ACQUIRE, 2, *slot.keys, slot.socket_id, user_limit, tenant_limit, SLOT_TTL_S)
        except RedisError:
            log.warning("socket limits unavailable (Redis); letting the socket through", exc_info=True)
            return None
        return None if full == 0 else Refusal("user" if full == 1 else "tenant", (user_limit, tenant_limit)[full - 1])

    async def refresh(self, slot: Slot) -> None:
        try:
            await self._client().eval(REFRESH, 2, *slot.keys, slot.socket_id, SLOT_TTL_S)
        except RedisError:
            log.warning("could not refresh a socket's slot (Redis)", exc_info=True)

    async def release(self, slot: Slot) -> None:
        try:
            async with self._client().pipeline(transaction=False) as pipe:
                for key in slot.keys:
                    pipe.zrem(key, slot.socket_id)
                await pipe.execute()
        except RedisError:
            log.warning("could not free a socket's slot (Redis); it expires in %d s", SLOT_TTL_S, exc_info=True)


def _refusal(user_count: int, tenant_count: int) -> Refusal | None:
    user_limit, tenant_limit = limits()
    if user_count >= user_limit:
        return Refusal("user", user_limit)
    if tenant_count >= tenant_limit:
        return Refusal("tenant", tenant_limit)
    return None


_local = LocalSlots()


@cache
def _redis_slots(url: str) -> RedisSlots:
    return RedisSlots(url)


def socket_slots() -> SocketSlots:
    """Where this process counts sockets: Redis when REDIS_URL is set, else its own memory."""
    return _redis_slots(settings.REDIS_URL) if settings.REDIS_URL else _local
