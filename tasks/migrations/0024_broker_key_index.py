"""An index on django-q2's broker table by key and lock: each step's probe (tasks/kicks.py `waiting`) asks
whether a job waits under a key, and the broker's dequeue reads due rows of its keys. django-q2 ships the
table with its primary key alone, so both scanned every row, dead ones included, of a table that churns."""

from django.db import migrations

INDEX = "longhaul_ormq_key_lock_idx"


class Migration(migrations.Migration):

    dependencies = [
        ('tasks', '0023_operations_requested_notify'),
        ('django_q', '0019_alter_task_options_alter_ormq_key_alter_ormq_lock_and_more'),
    ]

    operations = [
        migrations.RunSQL(f"CREATE INDEX IF NOT EXISTS {INDEX} ON django_q_ormq (key, lock)",
                          f"DROP INDEX IF EXISTS {INDEX}"),
    ]
