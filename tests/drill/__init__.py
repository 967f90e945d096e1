"""The fault drill: real qcluster and daphne processes under a mixed load, with faults injected.

    harness.py     the drill: starts processes and fakes, runs the load and the fault timeline,
                   waits for quiescence, checks the invariants, prints a one-line summary
    load.py        what users do: sleep and research tasks over the REST API (token auth), chat
                   messages that start tasks in threads, and WebSocket watchers that drop and
                   reconnect with ?after=<last seq>
    faults.py      what goes wrong: kill -9 of workers, SIGTERM drains, a PostgreSQL restart,
                   duplicate and pointless kicks
    gateways.py    loopback fakes of an OpenAI-compatible model server and a search/web site
                   that answer with 500s, 429s, 503s and timeouts some of the time
    invariants.py  what must hold afterwards, each check returning the violations it found
    stream.py      a blocking WebSocket client (autobahn on daphne's Twisted reactor)

Used by tests/acceptance/test_drill.py (about a minute) and bench/drill.py (--minutes N).
"""
