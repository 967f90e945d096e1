from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand
from django.db import transaction

from tasks.models import Membership, Tenant

DEMO_TENANT = "demo"
DEMO_USER = "demo"
DEMO_PASSWORD = "longhaul-demo"


class Command(BaseCommand):
    help = "Create the demo tenant and user (idempotent). Development credentials: demo / longhaul-demo."

    def handle(self, *args, **options):
        User = get_user_model()
        with transaction.atomic():
            tenant, _ = Tenant.objects.get_or_create(slug=DEMO_TENANT, defaults={"name": "Demo workspace"})
            user, created = User.objects.get_or_create(username=DEMO_USER)
            if created:
                user.set_password(DEMO_PASSWORD)
                user.save(update_fields=["password"])
            Membership.objects.get_or_create(user=user, tenant=tenant, defaults={"role": Membership.Role.ADMIN})
        state = "created" if created else "already there"
        self.stdout.write(f"Demo workspace ready ({state}). Sign in as {DEMO_USER} / {DEMO_PASSWORD}")
