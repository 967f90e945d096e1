"""Shared fixtures: tenants and named users (alice and bob in acme, charlie in globex), and root, a superuser."""

from __future__ import annotations

import uuid

import pytest
from django.contrib.auth.models import User
from django.test import Client
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from tasks import gateway_thread
from tasks.heartbeat import heartbeat
from tasks.models import Membership, Tenant


@pytest.fixture(autouse=True)
def _test_settings(settings):
    settings.LONGHAUL_DEBUG_DRIVERS = True
    # Hashing a password the real way costs ~0.3 s a user; tests make many users.
    # Suites whose child processes verify passwords (e2e) put the real hashers back.
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    # A cache of each test's own: no test meets another's request throttle counts (project/throttles.py),
    # which SQLite's reused primary keys would otherwise share between tests.
    settings.CACHES = {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache",
                                   "LOCATION": f"test-{uuid.uuid4()}"}}


@pytest.fixture(autouse=True)
def _gateway_threads_end_with_their_test():
    """A gateway job a test ran through its job function goes on on a thread of its own (tasks/gateway_thread.py):
    it ends before the next test, whose tables it would otherwise read."""
    yield
    gateway_thread.join(timeout=120)  # its calls time out well before: a thread still running is a failure to see
    assert not gateway_thread.running(), "a gateway thread of this test is still running"


@pytest.fixture(autouse=True)
def _no_beats_inside_a_rolled_back_test(request, monkeypatch):
    """A test that runs in one transaction, rolled back at its end, makes task rows that the heartbeat thread's own
    connection cannot see: a beat that happened to fall during one of its steps found the lease gone and stopped
    the step (a rare failure, likelier on a loaded machine). There nobody renews leases; transactional tests, whose
    rows the thread sees, keep the real heartbeat (test_one_execution_model.py, test_mcp_*.py)."""
    marker = request.node.get_closest_marker("django_db")
    transactional = (marker is not None and marker.kwargs.get("transaction", False)
                     or "transactional_db" in request.fixturenames or "live_server" in request.fixturenames)
    if not transactional:
        monkeypatch.setattr(heartbeat, "beat_once", lambda: None)


@pytest.fixture
def acme(db) -> Tenant:
    return Tenant.objects.create(slug="acme", name="Acme", max_running=4, max_queued=100)


@pytest.fixture
def globex(db) -> Tenant:
    return Tenant.objects.create(slug="globex", name="Globex", max_running=4, max_queued=100)


def make_user(username: str, tenant: Tenant, *, role: str = Membership.Role.MEMBER) -> User:
    user = User.objects.create_user(username=username, password=f"{username}-password-1")
    Membership.objects.create(user=user, tenant=tenant, role=role)
    return user


@pytest.fixture
def alice(acme) -> User:
    return make_user("alice", acme)


@pytest.fixture
def bob(acme) -> User:
    return make_user("bob", acme)


@pytest.fixture
def charlie(globex) -> User:
    return make_user("charlie", globex)


def api_client_for(user: User) -> APIClient:
    client = APIClient()
    token, _ = Token.objects.get_or_create(user=user)
    client.credentials(HTTP_AUTHORIZATION=f"Token {token.key}")
    return client


@pytest.fixture
def alice_api(alice) -> APIClient:
    return api_client_for(alice)


@pytest.fixture
def charlie_api(charlie) -> APIClient:
    return api_client_for(charlie)


@pytest.fixture
def root(db) -> User:
    return User.objects.create_superuser("root", password="root-password-1")


@pytest.fixture
def root_client(root) -> Client:
    client = Client()
    client.force_login(root)
    return client
