"""The webhook sweep runs as a django-q2 schedule, once a minute (tasks' sweeper stays unaware of webhooks)."""
# ruff: noqa: RUF012 (Django's migration class attributes)

from django.db import migrations

NAME = "longhaul.webhooks_sweep"


def create(apps, schema_editor):
    apps.get_model("django_q", "Schedule").objects.update_or_create(
        name=NAME, defaults={"func": "webhooks.jobs.sweep", "schedule_type": "I", "minutes": 1, "repeats": -1})


def remove(apps, schema_editor):
    apps.get_model("django_q", "Schedule").objects.filter(name=NAME).delete()


class Migration(migrations.Migration):
    dependencies = [
        ("webhooks", "0001_initial"),
        ("django_q", "0019_alter_task_options_alter_ormq_key_alter_ormq_lock_and_more"),
    ]
    operations = [migrations.RunPython(create, remove)]
