from django.core.management.base import BaseCommand, CommandError

from tasks import rekey
from tasks.models import Tenant


class Command(BaseCommand):
    help = ("Give a tenant a new data key and reseal its content under it, in batches, while the system runs. "
            "Also seals rows written before encryption was on.")

    def add_arguments(self, parser):
        parser.add_argument("tenant", help="the tenant's slug")
        parser.add_argument("--batch", type=int, default=500, help="rows per transaction (default 500)")

    def handle(self, *args, tenant, batch, **options):
        if batch < 1:
            raise CommandError("--batch must be at least 1")
        found = Tenant.objects.filter(slug=tenant).first()
        if found is None:
            raise CommandError(f"no tenant {tenant!r}")
        version, counts = rekey.reseal_tenant(found.pk, batch=batch, progress=lambda line: self.stdout.write(line))
        total = sum(n for table, n in counts.items() if not table.endswith("tampered"))
        tampered = sum(n for table, n in counts.items() if table.endswith("tampered"))
        self.stdout.write(f"Resealed {total} rows of {tenant} under key v{version}"
                          + (f"; {tampered} rows failed their integrity check and were left (see above)."
                             if tampered else "."))
        if tampered:
            raise CommandError(f"{tampered} rows of {tenant} failed their integrity check")
