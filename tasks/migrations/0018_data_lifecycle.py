# Data lifecycle (DESIGN §14): deletion of running tasks, per-tenant retention.

import django.db.models.deletion
from django.conf import settings
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('chat', '0009_data_lifecycle'),
        ('tasks', '0017_yield_requested'),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.AddField(
            model_name='retentionmark',
            name='tenant',
            field=models.ForeignKey(blank=True, help_text='The tenant whose override this pass follows; empty: everyone else.', null=True, on_delete=django.db.models.deletion.CASCADE, related_name='+', to='tasks.tenant'),
        ),
        migrations.AddField(
            model_name='task',
            name='delete_requested_at',
            field=models.DateTimeField(blank=True, help_text='Its owner deleted it (or its thread) while it could still run: hidden at once, cancelled, and deleted by the sweeper once it has ended (tasks/deletion.py).', null=True),
        ),
        migrations.AddField(
            model_name='task',
            name='delete_requested_by',
            field=models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.SET_NULL, related_name='+', to=settings.AUTH_USER_MODEL),
        ),
        migrations.AddField(
            model_name='tenant',
            name='retention',
            field=models.JSONField(blank=True, default=dict, help_text="Per data class, the days this tenant's data is kept instead of the system's LONGHAUL_RETENTION_<CLASS>_DAYS (0: for ever); set in the admin, checked by tasks/retention.py."),
        ),
        migrations.AlterField(
            model_name='retentionmark',
            name='data_class',
            field=models.CharField(max_length=32),
        ),
        migrations.AddIndex(
            model_name='task',
            index=models.Index(condition=models.Q(('delete_requested_at__isnull', False)), fields=['id'], name='task_delete_pending_idx'),
        ),
        migrations.AddConstraint(
            model_name='retentionmark',
            constraint=models.UniqueConstraint(condition=models.Q(('tenant__isnull', True)), fields=('data_class',), name='retention_mark_system_unique'),
        ),
        migrations.AddConstraint(
            model_name='retentionmark',
            constraint=models.UniqueConstraint(condition=models.Q(('tenant__isnull', False)), fields=('data_class', 'tenant'), name='retention_mark_tenant_unique'),
        ),
    ]
