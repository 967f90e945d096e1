"""The foundation: sign-in, the chat shell, tenancy on pages and /api/me, health, schema, commands."""

from __future__ import annotations

import re
from html.parser import HTMLParser
from io import StringIO

import pytest
from django.contrib.auth.models import User
from django.core.management import call_command
from django.core.management.base import CommandError
from django.http import HttpRequest  # django-axes checks lockouts per request; authenticate() needs one
from django.test import Client
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from tasks.management.commands import adduser
from tasks.models import Membership, Tenant
from tests.conftest import api_client_for, make_user

pytestmark = pytest.mark.django_db


class ElementsById(HTMLParser):
    """Collects each element that has an id: its tag and attributes."""

    def __init__(self) -> None:
        super().__init__()
        self.elements: dict[str, tuple[str, dict[str, str | None]]] = {}

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = dict(attrs)
        if found.get("id"):
            self.elements[found["id"]] = (tag, found)


def elements_by_id(html: str) -> dict[str, tuple[str, dict[str, str | None]]]:
    parser = ElementsById()
    parser.feed(html)
    return parser.elements


def run(command: str, *args: str) -> str:
    out = StringIO()
    call_command(command, *args, stdout=out)
    return out.getvalue()


# --- Pages ----------------------------------------------------------------------


@pytest.mark.smoke
def test_it_sends_anonymous_visitors_to_the_login_page(client: Client):
    response = client.get("/")
    assert response.status_code == 302
    assert response["Location"].startswith("/accounts/login/")


@pytest.mark.smoke
def test_it_renders_a_login_form_with_labelled_fields(client: Client):
    response = client.get("/accounts/login/")
    html = response.content.decode()
    assert response.status_code == 200
    assert '<label for="id_username">' in html
    assert '<label for="id_password">' in html
    assert 'name="csrfmiddlewaretoken"' in html


def test_it_reports_a_failed_sign_in_as_an_alert(client: Client, alice: User):
    response = client.post("/accounts/login/", {"username": "alice", "password": "wrong"})
    assert response.status_code == 200
    assert 'role="alert"' in response.content.decode()
    assert "_auth_user_id" not in client.session


def test_it_signs_alice_in_and_shows_the_chat_shell(client: Client, alice: User):
    response = client.post("/accounts/login/", {"username": "alice", "password": "alice-password-1"})
    assert response.status_code == 302 and response["Location"] == "/"

    response = client.get("/")
    html = response.content.decode()
    elements = elements_by_id(html)

    assert response.status_code == 200
    assert "Longhaul" in html and "Acme" in html
    toggle_tag, toggle = elements["panel-toggle"]
    assert toggle_tag == "button"
    assert toggle["aria-controls"] == "task-panel"
    assert toggle["aria-expanded"] == "false"
    panel_tag, panel = elements["task-panel"]
    assert panel_tag == "aside"
    assert panel.get("aria-labelledby") == "task-panel-title" or panel.get("aria-label") == "Background tasks"
    assert "Background tasks" in html
    assert "hidden" in panel
    assert elements["new-thread"][0] == "button"
    assert {"thread-list", "conversation", "composer", "composer-input", "send"} <= elements.keys()
    assert re.search(r'<h3[^>]*>\s*Active\s*</h3>', html) and re.search(r'<h3[^>]*>\s*Recent\s*</h3>', html)
    panel_html = html[html.index('id="task-panel"'):html.index("</aside>")]
    assert 'id="task-live"' in panel_html and elements["task-live"][1]["aria-live"] == "polite"
    assert "hidden" in elements["task-count"][1]
    assert "No threads yet" in html
    assert re.search(r'<form[^>]*method="post"[^>]*action="/accounts/logout/"', html)


def test_it_explains_a_missing_workspace_instead_of_crashing(client: Client, db):
    loner = User.objects.create_user(username="loner", password="loner-password-1")
    client.force_login(loner)
    response = client.get("/")
    assert response.status_code == 403
    assert "no_tenant.html" in [t.name for t in response.templates]
    assert "loner" in response.content.decode()


def test_it_renders_the_designed_404_page_for_pages_and_json_for_the_api(client: Client, alice: User):
    client.force_login(alice)
    page = client.get("/no/such/page")
    api = client.get("/api/no-such-endpoint")
    assert page.status_code == 404 and "404.html" in [t.name for t in page.templates]
    assert api.status_code == 404 and api.json() == {"error": "not found", "code": "not_found"}


# --- Health, schema, API errors ---------------------------------------------------


@pytest.mark.smoke
def test_it_answers_healthz_when_the_database_answers(client: Client):
    response = client.get("/healthz")
    assert response.status_code == 200
    assert response["Content-Type"] == "application/json"
    assert response.json()["status"] == "ok"


def test_it_refuses_anonymous_api_calls_with_the_error_shape(client: Client):
    response = client.get("/api/tasks")
    assert response.status_code in (401, 403)
    body = response.json()
    assert body["code"] == "not_authenticated"
    assert body["error"]


def test_it_publishes_an_openapi_schema_naming_the_task_endpoints(client: Client):
    response = client.get("/api/schema")
    text = response.content.decode()
    assert response.status_code == 200
    assert "/api/tasks" in text
    assert "/api/me" in text


# --- /api/me ----------------------------------------------------------------------


def test_it_tells_alice_who_she_is(alice_api: APIClient, bob: User):
    response = alice_api.get("/api/me")
    assert response.status_code == 200
    assert response.json() == {
        "username": "alice",
        "tenant": {"slug": "acme", "name": "Acme"},
        "memberships": [{"tenant": "acme", "role": "member"}],
    }


def test_it_never_shows_charlie_another_tenants_memberships(charlie_api: APIClient, alice: User, bob: User):
    response = charlie_api.get("/api/me")
    body = response.json()
    assert response.status_code == 200
    assert body["tenant"] == {"slug": "globex", "name": "Globex"}
    assert body["memberships"] == [{"tenant": "globex", "role": "member"}]
    assert "acme" not in response.content.decode().lower()


def test_it_never_shows_alice_globex(alice_api: APIClient, charlie: User):
    text = alice_api.get("/api/me").content.decode().lower()
    assert "globex" not in text
    assert "charlie" not in text


def test_it_lists_every_own_membership_and_honours_the_tenant_header(acme: Tenant, globex: Tenant):
    dana = make_user("dana", acme)
    Membership.objects.create(user=dana, tenant=globex, role=Membership.Role.ADMIN)
    client = api_client_for(dana)

    default = client.get("/api/me").json()
    chosen = client.get("/api/me", HTTP_X_LONGHAUL_TENANT="globex").json()

    assert default["memberships"] == [{"tenant": "acme", "role": "member"}, {"tenant": "globex", "role": "admin"}]
    assert default["tenant"]["slug"] == "acme"
    assert chosen["tenant"] == {"slug": "globex", "name": "Globex"}


def test_it_answers_me_for_a_user_without_a_workspace(db):
    loner = User.objects.create_user(username="loner", password="loner-password-1")
    body = api_client_for(loner).get("/api/me").json()
    assert body == {"username": "loner", "tenant": None, "memberships": []}


def test_it_refuses_me_to_anonymous_callers(client: Client):
    response = client.get("/api/me")
    assert response.status_code in (401, 403)
    assert set(response.json()) >= {"error", "code"}


# --- Management commands --------------------------------------------------------------


@pytest.mark.smoke
def test_it_seeds_the_demo_workspace_once(client: Client):
    first = run("seed_demo")
    run("seed_demo")

    assert Tenant.objects.filter(slug="demo").count() == 1
    assert User.objects.filter(username="demo").count() == 1
    assert Membership.objects.filter(user__username="demo", tenant__slug="demo").count() == 1
    username, password = re.search(r"Sign in as (\S+) / (\S+)", first).groups()
    assert client.login(request=HttpRequest(), username=username, password=password)


def test_it_creates_a_tenant():
    out = run("createtenant", "initech", "--name", "Initech", "--max-running", "2")
    tenant = Tenant.objects.get(slug="initech")
    assert "initech" in out
    assert (tenant.name, tenant.max_running) == ("Initech", 2)


def test_it_refuses_a_tenant_weight_above_the_systems_ceiling():
    with pytest.raises(CommandError, match="--weight: weight must be a whole number from 0 to 10"):
        run("createtenant", "initech", "--name", "Initech", "--weight", "11")
    assert not Tenant.objects.exists()


@pytest.mark.parametrize("slug", ["Bad Slug", "UPPER", "under_score!"])
def test_it_refuses_a_bad_tenant_slug(slug: str):
    with pytest.raises(CommandError, match="slug .* must be lowercase letters, digits and hyphens"):
        run("createtenant", slug, "--name", "Bad")
    assert not Tenant.objects.exists()


def test_it_refuses_a_duplicate_tenant(acme: Tenant):
    with pytest.raises(CommandError, match="tenant 'acme' already exists"):
        run("createtenant", "acme", "--name", "Acme again")
    assert Tenant.objects.get(slug="acme").name == "Acme"


def test_it_adds_a_user_with_a_password_given(client: Client, acme: Tenant):
    run("adduser", "erin", "--tenant", "acme", "--admin", "--password", "erin-password-1")
    assert Membership.objects.get(user__username="erin").role == Membership.Role.ADMIN
    assert client.login(request=HttpRequest(), username="erin", password="erin-password-1")


def test_it_prints_a_generated_password_once_and_it_works(monkeypatch, client: Client, acme: Tenant):
    # Under `pytest -s` stdin may be a terminal; the command must not prompt here.
    monkeypatch.setattr(adduser.Command, "stdin_is_tty", staticmethod(lambda: False))
    out = run("adduser", "frank", "--tenant", "acme")
    passwords = re.findall(r"Password \(shown once\): (\S+)", out)
    assert len(passwords) == 1
    assert out.count(passwords[0]) == 1
    assert client.login(request=HttpRequest(), username="frank", password=passwords[0])


def test_it_refuses_a_duplicate_user(alice: User):
    with pytest.raises(CommandError, match="user 'alice' already exists"):
        run("adduser", "alice", "--tenant", "acme", "--password", "another-password-1")
    assert Membership.objects.filter(user=alice).count() == 1


def test_it_refuses_to_add_a_user_to_an_unknown_tenant(db):
    with pytest.raises(CommandError, match="no tenant 'nowhere'"):
        run("adduser", "gina", "--tenant", "nowhere", "--password", "gina-password-1")
    assert not User.objects.filter(username="gina").exists()


def test_it_creates_an_api_token_that_authenticates(alice: User):
    out = run("drf_create_token", "alice")
    token = Token.objects.get(user=alice)
    assert token.key in out
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {token.key}")
    assert client.get("/api/me").json()["username"] == "alice"
