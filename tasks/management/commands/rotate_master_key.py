from django.core.management.base import BaseCommand, CommandError

from tasks import crypto
from tasks.errors import LonghaulError


class Command(BaseCommand):
    help = ("Re-wrap every tenant's data key under the current master key (the first of LONGHAUL_MASTER_KEYS). "
            "Content is not touched. Keep the old key listed after the new one until this has run.")

    def handle(self, *args, **options):
        try:
            moved = crypto.rewrap_all(progress=lambda line: self.stdout.write(line))
        except LonghaulError as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(f"Re-wrapped {moved} data key{'s' if moved != 1 else ''} under "
                          f"{crypto.current_master_id()}.")
