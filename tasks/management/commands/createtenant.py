from django.core.management.base import BaseCommand, CommandError
from django.utils.text import slugify

from tasks.actions import check_quota
from tasks.errors import InvalidInput
from tasks.models import Tenant


class Command(BaseCommand):
    help = "Create a tenant (a workspace with its own users, tasks and quotas)."

    def add_arguments(self, parser):
        parser.add_argument("slug")
        parser.add_argument("--name", required=True)
        parser.add_argument("--max-running", type=int, default=4)
        parser.add_argument("--max-queued", type=int, default=1000)
        parser.add_argument("--weight", type=int, default=1)

    def handle(self, *args, slug, name, max_running, max_queued, weight, **options):
        if slugify(slug) != slug:
            raise CommandError(f"slug {slug!r} must be lowercase letters, digits and hyphens")
        for flag, quota, value in (("--max-running", "max_running", max_running),
                                   ("--max-queued", "max_queued", max_queued), ("--weight", "weight", weight)):
            if value < 1:
                raise CommandError(f"{flag} must be at least 1")
            try:
                check_quota(quota, value)
            except InvalidInput as exc:
                raise CommandError(f"{flag}: {exc}") from None
        if Tenant.objects.filter(slug=slug).exists():
            raise CommandError(f"tenant {slug!r} already exists")
        Tenant.objects.create(slug=slug, name=name, max_running=max_running, max_queued=max_queued, weight=weight)
        self.stdout.write(f"Created tenant {slug}.")
