"""Each person's language (the switch in the page header), kept on the server so it follows them."""

import django.db.models.deletion
from django.conf import settings
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
        ("chat", "0003_sweep_schedule"),
    ]

    operations = [
        migrations.CreateModel(
            name="LanguagePreference",
            fields=[
                ("user", models.OneToOneField(on_delete=django.db.models.deletion.CASCADE, primary_key=True,
                                              related_name="language_preference", serialize=False,
                                              to=settings.AUTH_USER_MODEL)),
                ("chosen", models.CharField(blank=True, max_length=16,
                                            help_text="Picked with the switch in the header; empty: follow the browser.")),
                ("last_shown", models.CharField(blank=True, max_length=16)),
            ],
        ),
    ]
