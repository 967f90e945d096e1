"""Signed webhooks for task events (DESIGN §15): endpoints, a delivery outbox, a job that sends it.

    models.py      Endpoint (a tenant's URL, events and secrets) and Delivery (the outbox row)
    outbox.py      the delivery state machine: every status change, one guarded UPDATE each
    payloads.py    what a delivery says: the task's public projection and the event
    signing.py     secrets and Standard Webhooks signatures (the standardwebhooks package)
    destinations.py  which URLs may be registered and sent to (visit's address rules)
    sender.py      one signed POST: pinned address, no redirects, timeout, response size cap
    endpoints.py   register, change, rotate, remove (each audited); the API and the admin call these
    jobs.py        the django-q2 jobs: deliver one row; sweep for lost kicks and dead claimers
    api.py         /api/webhooks for tenants; admin.py for operators
"""
