"""Settings for bench/idle.py's baseline: Longhaul's, but django-q2's own ORM broker, which sleeps its poll
interval whenever its queue is empty (`manage.py qcluster --settings` is not how it is started: the
benchmark sets DJANGO_SETTINGS_MODULE to this module)."""

from project.settings import *

Q_CLUSTER = {**Q_CLUSTER, "broker_class": "django_q.brokers.orm.ORM"}
