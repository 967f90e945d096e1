import getpass
import secrets

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError
from django.db import transaction

from tasks.models import Membership, Tenant


class Command(BaseCommand):
    help = "Create a user in a tenant. Without --password: prompt, or print a generated one once."

    def add_arguments(self, parser):
        parser.add_argument("username")
        parser.add_argument("--tenant", required=True, help="tenant slug")
        parser.add_argument("--admin", action="store_true", help="tenant admin (sees all the tenant's tasks)")
        parser.add_argument("--staff", action="store_true", help="may sign in to the Django admin")
        parser.add_argument("--password")

    def handle(self, *args, username, tenant, admin, staff, password, **options):
        target = Tenant.objects.filter(slug=tenant).first()
        if target is None:
            raise CommandError(f"no tenant {tenant!r}; create it with: manage.py createtenant {tenant} --name ...")
        User = get_user_model()
        if User.objects.filter(username=username).exists():
            raise CommandError(f"user {username!r} already exists")
        generated = False
        if password is None:
            if options.get("interactive", True) and self.stdin_is_tty():
                password = getpass.getpass(f"Password for {username}: ")
            if not password:
                password, generated = secrets.token_urlsafe(12), True
        with transaction.atomic():
            user = User.objects.create_user(username=username, password=password, is_staff=staff)
            role = Membership.Role.ADMIN if admin else Membership.Role.MEMBER
            Membership.objects.create(user=user, tenant=target, role=role)
        self.stdout.write(f"Created user {username} in {tenant} ({role}).")
        if generated:
            self.stdout.write(f"Password (shown once): {password}")

    @staticmethod
    def stdin_is_tty() -> bool:
        import sys

        return sys.stdin is not None and sys.stdin.isatty()
