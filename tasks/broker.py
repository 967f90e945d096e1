"""django-q2's ORM broker, reading a cluster's own queue and the step kicks beside it.

Kicks to run a task's next step (`advance`) go under a key of their own (`<cluster>:steps`),
and so do kicks for a gateway job (`<cluster>:gateway`); the same cluster's workers take both
as before. Only what sits under the cluster's own
key is work a worker running steps should make way for (a delivery, a sweep): a step kick
is only a hint for a task that is due in the task table, where a worker that is already
running steps takes it straight away (tasks/runner.py), and a gateway kick is only a hint
while a gateway job holds the turn, which hears the calls requested (tasks/requested.py).
Keeping them apart is what lets the runner's probe tell them apart in one indexed query.
"""

from __future__ import annotations

from time import sleep

from django.utils import timezone
from django_q.brokers.orm import ORM
from django_q.conf import Conf

STEPS_SUFFIX = ":steps"
GATEWAY_SUFFIX = ":gateway"


def steps_key(cluster: str) -> str:
    """The broker key of `cluster`'s step kicks."""
    return f"{cluster}{STEPS_SUFFIX}"


def gateway_key(cluster: str) -> str:
    """The broker key of `cluster`'s gateway kicks."""
    return f"{cluster}{GATEWAY_SUFFIX}"


class Broker(ORM):
    """The ORM broker over three keys: the cluster's queue, its step kicks and its gateway kicks."""

    @property
    def keys(self) -> tuple[str, str, str]:
        return self.list_key, steps_key(self.list_key), gateway_key(self.list_key)

    def queue_size(self) -> int:
        return self.get_connection().filter(key__in=self.keys, lock__lte=timezone.now()).count()

    def lock_size(self) -> int:
        return self.get_connection().filter(key__in=self.keys, lock__gt=timezone.now()).count()

    def purge_queue(self):
        return self.get_connection().filter(key__in=self.keys).delete()

    def dequeue(self):
        # ORM.dequeue, over its keys (in no order, as there: an ORDER BY would sort every due row each poll).
        rows = list(self.get_connection().filter(key__in=self.keys, lock__lt=timezone.now())[:Conf.BULK])
        taken = [(row.pk, row.payload) for row in rows
                 # Another cluster may have been faster on a row: then its lock moved on, and this takes nothing.
                 if self.get_connection().filter(id=row.id, lock=row.lock).update(lock=self.timeout(row))]
        if taken:
            return taken
        if not rows:
            sleep(Conf.POLL)  # an empty queue: spare the CPU, as ORM.dequeue does
        return None
