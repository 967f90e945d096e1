"""On PostgreSQL, each commit that inserts operations a gateway job should run now notifies the channel
`longhaul_operations`, so a gateway job already running claims them at once instead of at its next look
(tasks/requested.py). A statement trigger: no statement of the step's own, one notification per commit
however many rows."""

from django.db import migrations

CHANNEL = "longhaul_operations"  # tasks.requested.CHANNEL, as it was when this migration was written
CREATE = f"""
CREATE OR REPLACE FUNCTION longhaul_operations_requested() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    -- Only for calls a gateway job runs now: a NOTIFY serializes the commits that send one.
    IF EXISTS (SELECT 1 FROM requested WHERE mode = 'gateway' AND (not_before IS NULL OR not_before <= now())) THEN
        PERFORM pg_notify('{CHANNEL}', '');
    END IF;
    RETURN NULL;
END $$;
CREATE TRIGGER operations_requested AFTER INSERT ON tasks_operation
    REFERENCING NEW TABLE AS requested
    FOR EACH STATEMENT EXECUTE FUNCTION longhaul_operations_requested();
"""
DROP = """
DROP TRIGGER IF EXISTS operations_requested ON tasks_operation;
DROP FUNCTION IF EXISTS longhaul_operations_requested();
"""


def create(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(CREATE)


def drop(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(DROP)


class Migration(migrations.Migration):

    dependencies = [
        ('tasks', '0022_sweep_cursor'),
    ]

    operations = [migrations.RunPython(create, drop)]
