"""Messages numbered per thread (seq from 1, without gaps) instead of by the global id.

Existing messages are numbered in their old id order, which was their order in the
thread; each thread's counter starts after its newest message.
"""

from django.db import migrations, models

NUMBER_MESSAGES = """
UPDATE chat_message SET seq = numbered.n
FROM (SELECT id, ROW_NUMBER() OVER (PARTITION BY thread_id ORDER BY id) AS n FROM chat_message) AS numbered
WHERE chat_message.id = numbered.id
"""

SET_COUNTERS = """
UPDATE chat_thread SET message_seq = COALESCE((SELECT MAX(seq) FROM chat_message WHERE thread_id = chat_thread.id), 0)
"""


class Migration(migrations.Migration):

    dependencies = [
        ("chat", "0006_proposals"),
    ]

    operations = [
        migrations.AddField(
            model_name="thread",
            name="message_seq",
            field=models.PositiveIntegerField(default=0, help_text="The seq of the thread's newest message."),
        ),
        migrations.AddField(
            model_name="message",
            name="seq",
            field=models.PositiveIntegerField(editable=False, null=True),
        ),
        migrations.RunSQL(NUMBER_MESSAGES, migrations.RunSQL.noop),
        migrations.RunSQL(SET_COUNTERS, migrations.RunSQL.noop),
        migrations.AlterField(
            model_name="message",
            name="seq",
            field=models.PositiveIntegerField(editable=False),
        ),
        migrations.AlterModelOptions(
            name="message",
            options={"ordering": ["thread", "seq"]},
        ),
        migrations.RemoveIndex(
            model_name="message",
            name="message_thread_order_idx",
        ),
        migrations.AddConstraint(
            model_name="message",
            constraint=models.UniqueConstraint(fields=("thread", "seq"), name="message_thread_seq_unique"),
        ),
    ]
