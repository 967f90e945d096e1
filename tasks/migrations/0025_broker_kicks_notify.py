"""On PostgreSQL, each commit that puts a job on django-q2's broker table due now notifies the channel
`longhaul_kicks`, so a cluster's pusher waiting on an empty queue takes it at once instead of at the end of
its poll interval (tasks/broker.py). A statement trigger, as migration 0023's: no statement of the
enqueuer's own, one notification per commit however many rows; a job put off to later (a delayed kick)
notifies nothing, the pusher's polls find it."""

from django.db import migrations

CHANNEL = "longhaul_kicks"  # tasks.broker.CHANNEL, as it was when this migration was written
CREATE = f"""
CREATE OR REPLACE FUNCTION longhaul_broker_kicked() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    -- Due now, by the clock rather than now() (the enqueuer's transaction may have begun well before it
    -- stamped the row), with a second's slack for a clock the application's host reads differently.
    -- The payload is the row's key: a pusher wakes only for its own cluster's keys.
    PERFORM pg_notify('{CHANNEL}', due.key)
    FROM (SELECT DISTINCT key FROM kicked WHERE lock <= clock_timestamp() + interval '1 second') AS due;
    RETURN NULL;
END $$;
CREATE TRIGGER broker_kicked AFTER INSERT ON django_q_ormq
    REFERENCING NEW TABLE AS kicked
    FOR EACH STATEMENT EXECUTE FUNCTION longhaul_broker_kicked();
"""
DROP = """
DROP TRIGGER IF EXISTS broker_kicked ON django_q_ormq;
DROP FUNCTION IF EXISTS longhaul_broker_kicked();
"""


def create(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(CREATE)


def drop(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(DROP)


class Migration(migrations.Migration):

    dependencies = [
        ('tasks', '0024_broker_key_index'),
    ]

    operations = [migrations.RunPython(create, drop)]
