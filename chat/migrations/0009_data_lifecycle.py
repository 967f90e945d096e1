"""Threads are deleted, not marked: the ones marked deleted before go now, with their messages, runs,
proposals and stream items (their tasks stay, without a thread, as they were)."""

from django.db import migrations


def delete_marked_threads(apps, schema_editor):
    apps.get_model("chat", "Thread").objects.filter(deleted=True).delete()


class Migration(migrations.Migration):

    dependencies = [
        ("chat", "0008_thread_items_and_retention"),
    ]

    operations = [
        migrations.RunPython(delete_marked_threads, migrations.RunPython.noop),
        migrations.RemoveField(model_name="thread", name="deleted"),
    ]
