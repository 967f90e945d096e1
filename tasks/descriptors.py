"""How many calls a gateway job may keep out, as the process's open-file limit allows.

Each call out holds a socket, and each of the job's HTTP clients keeps its share of LONGHAUL_GATEWAY_INFLIGHT
idle connections open between calls (tasks/operations.py), so a job at its cap may hold about twice the cap
in sockets, beside its database connections and the worker's own files. A soft limit below that (1,024 is
common, under systemd among others) would fail calls with "too many open files" at the busiest moment. So a
job first raises the process's soft limit as far as needed, within the hard limit (no privilege needed),
and if that is still too low, keeps fewer calls out than its cap and says so once. The raised limit stays
for the process and what it starts; descriptors past 1,024 are beyond select(), which nothing here uses
(asyncio's loop and psycopg wait with epoll and poll).
"""

from __future__ import annotations

import functools
import logging
import resource

log = logging.getLogger(__name__)
SOCKETS_PER_CALL = 2  # the call's own connection, and as many again kept idle by the job's client (for the APIs' hosts)
RESERVED = 64  # the worker's own files: database connections (three per job), logs, the broker's, the listener's


def calls_at_most(cap: int) -> int:
    """The calls a process's gateway jobs may keep out at once, together (operations.calls_out): `cap`, or fewer
    if the open-file limit is too low."""
    soft = _raised_soft_limit(cap * SOCKETS_PER_CALL + RESERVED)
    allowed = max(1, (soft - RESERVED) // SOCKETS_PER_CALL)
    if allowed < cap:
        _warn_once(cap, allowed, soft)
        return allowed
    return cap


def _raised_soft_limit(needed: int) -> int:
    """The soft limit on open files, raised to `needed` if it was lower and the hard limit allows."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return needed
    if soft >= needed:
        return soft
    target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    if target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:  # a sandbox may refuse even a raise within the hard limit
            _refused_once(soft, target, str(exc))
    return soft


@functools.cache
def _refused_once(soft: int, target: int, why: str) -> None:
    log.warning("could not raise the open-file limit from %s to %s: %s", soft, target, why)


@functools.cache
def _warn_once(cap: int, allowed: int, soft: int) -> None:
    log.warning("LONGHAUL_GATEWAY_INFLIGHT is %s, but the open-file limit (%s, the hard limit or what could be "
                "set) leaves room for %s calls out at once: a gateway job keeps %s out at most. Raise the limit "
                "(ulimit -n, LimitNOFILE=) to let it keep more.", cap, soft, allowed, allowed)
