# ruff: noqa: RUF012 (Django's migration class attributes)
import uuid

import django.db.models.deletion
from django.conf import settings
from django.db import migrations, models


class Migration(migrations.Migration):

    initial = True

    dependencies = [
        ('tasks', '0009_task_remote_facts'),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.CreateModel(
            name='Endpoint',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('public_id', models.UUIDField(default=uuid.uuid4, editable=False, unique=True)),
                ('url', models.CharField(help_text='http(s); checked by webhooks.destinations.', max_length=2000)),
                ('events', models.JSONField(default=list, help_text='Event types delivered, e.g. task.succeeded.')),
                ('description', models.CharField(blank=True, max_length=200)),
                ('enabled', models.BooleanField(default=True, help_text='Disabled: deliveries wait, undelivered, until enabled.')),
                ('secret', models.CharField(editable=False, max_length=100)),
                ('previous_secret', models.CharField(blank=True, editable=False, max_length=100)),
                ('previous_secret_expires_at', models.DateTimeField(blank=True, editable=False, null=True)),
                ('created_at', models.DateTimeField(editable=False)),
                ('secret_rotated_at', models.DateTimeField(blank=True, editable=False, null=True)),
                ('created_by', models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.SET_NULL, related_name='+', to=settings.AUTH_USER_MODEL)),
                ('owner', models.ForeignKey(blank=True, help_text="Only this user's tasks; empty: all of the tenant's.", null=True, on_delete=django.db.models.deletion.CASCADE, related_name='+', to=settings.AUTH_USER_MODEL)),
                ('tenant', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='webhook_endpoints', to='tasks.tenant')),
            ],
            options={
                'ordering': ('-created_at', '-id'),
            },
        ),
        migrations.CreateModel(
            name='Delivery',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('event_seq', models.PositiveBigIntegerField(help_text="The task event's seq: this delivery's version.")),
                ('event_type', models.CharField(max_length=40)),
                ('webhook_id', models.CharField(editable=False, max_length=40, unique=True)),
                ('body', models.TextField()),
                ('status', models.CharField(choices=[('pending', 'Pending'), ('claimed', 'Claimed'), ('retry', 'Retry'), ('delivered', 'Delivered'), ('dead_letter', 'Dead Letter'), ('superseded', 'Superseded')], default='pending', max_length=16)),
                ('attempts', models.PositiveIntegerField(default=0, help_text='Claims so far, a killed one included.')),
                ('next_attempt_at', models.DateTimeField(blank=True, null=True)),
                ('lease_owner', models.CharField(blank=True, max_length=200)),
                ('lease_expires_at', models.DateTimeField(blank=True, null=True)),
                ('last_error', models.TextField(blank=True)),
                ('last_status_code', models.PositiveSmallIntegerField(blank=True, null=True)),
                ('created_at', models.DateTimeField()),
                ('delivered_at', models.DateTimeField(blank=True, null=True)),
                ('task', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='+', to='tasks.task')),
                ('tenant', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='+', to='tasks.tenant')),
                ('endpoint', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='deliveries', to='webhooks.endpoint')),
            ],
            options={
                'verbose_name_plural': 'deliveries',
                'ordering': ('-created_at', '-id'),
                'indexes': [models.Index(condition=models.Q(('status__in', ['pending', 'retry'])), fields=['next_attempt_at'], name='webhook_delivery_due_idx'), models.Index(condition=models.Q(('status', 'claimed')), fields=['lease_expires_at'], name='webhook_delivery_claimed_idx'), models.Index(condition=models.Q(('status', 'dead_letter')), fields=['tenant', '-created_at'], name='webhook_delivery_dead_idx')],
                'constraints': [models.UniqueConstraint(fields=('endpoint', 'task', 'event_seq'), name='webhook_delivery_version_unique')],
            },
        ),
    ]
