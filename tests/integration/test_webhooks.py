"""Webhooks: each task event version delivered, signed, to the endpoints that may hear of it, at least
once and with a stable webhook-id, against a loopback receiver that verifies signatures."""

from __future__ import annotations

from datetime import timedelta

import pytest
import time_machine
from asgiref.sync import async_to_sync
from django.contrib.auth.models import User
from django.db import transaction
from django_q.models import OrmQ
from django_q.signing import SignedPackage
from standardwebhooks import Webhook
from standardwebhooks.webhooks import WebhookVerificationError

from tasks import clock, jobs, transitions
from tasks.events import NewEvent, append
from tasks.models import Alert, AuditEntry, Membership, Task
from tasks.serializers import TaskSerializer
from tasks.statuses import TaskStatus
from tests.conftest import api_client_for, make_user
from tests.factories import make_task, submit_sleep
from tests.fakes.webhook_receiver import WebhookReceiver, verified_by
from webhooks import jobs as webhook_jobs
from webhooks import outbox, sender, signing
from webhooks.models import Delivery, DeliveryStatus, Endpoint

D = DeliveryStatus
pytestmark = pytest.mark.django_db
LATER = timedelta(hours=3)  # past any backoff and any lease


@pytest.fixture(autouse=True)
def _webhook_settings(settings):
    settings.LONGHAUL_STEP_SLICE_MS = 0
    settings.LONGHAUL_ALLOW_PRIVATE_FETCH = True  # the receiver is on loopback
    settings.LONGHAUL_WEBHOOK_TIMEOUT_S = 5.0
    settings.LONGHAUL_WEBHOOK_MAX_ATTEMPTS = 3


@pytest.fixture
def receiver():
    with WebhookReceiver() as running:
        yield running


def register(client, url: str, events: list[str] | None = None, **extra) -> dict:
    response = client.post("/api/webhooks", {"url": url, "events": events or ["task.succeeded"], **extra},
                           format="json")
    assert response.status_code == 201, response.content
    return response.json()


def listen(client, receiver: WebhookReceiver, events: list[str] | None = None) -> dict:
    """Register the receiver for `events` and teach it the secret."""
    endpoint = register(client, receiver.url + "/hook", events)
    receiver.secrets.append(endpoint["secret"])
    return endpoint


def finish(task: Task) -> Task:
    for _ in range(20):
        task.refresh_from_db()
        if task.status == TaskStatus.SUCCEEDED:
            return task
        jobs.advance(task.pk)
    raise AssertionError(task.status)


def run_webhook_kicks(*, rounds: int = 20) -> list[str]:
    """Run the webhook kicks that are due by the (test) clock, as workers would, until none are left."""
    outcomes: list[str] = []
    for _ in range(rounds):
        due = []
        for row in OrmQ.objects.filter(lock__lte=clock.now()).order_by("id"):
            package = SignedPackage.loads(row.payload)
            if package["func"] == "webhooks.jobs.deliver":
                due.append((row.pk, package["args"][0]))
        if not due:
            return outcomes
        OrmQ.objects.filter(pk__in=[pk for pk, _ in due]).delete()
        outcomes += [webhook_jobs.deliver(delivery_id) for _, delivery_id in due]
    raise AssertionError("webhook kicks kept coming")


def deliveries(**filters) -> list[Delivery]:
    return list(Delivery.objects.filter(**filters).order_by("id"))


def later(delta: timedelta = LATER):
    return time_machine.travel(clock.now() + delta, tick=False)


# --- delivery ------------------------------------------------------------------------


def test_it_delivers_each_event_version_once_signed_with_the_public_task_shape(acme, alice, alice_api, receiver):
    endpoint = listen(alice_api, receiver)
    task = finish(submit_sleep(acme, alice, steps=1))

    assert run_webhook_kicks() == ["delivered"]
    [message] = receiver.accepted()
    assert message.verified_by == [0]
    payload = message.payload
    assert payload["type"] == "task.succeeded"
    assert payload["data"]["task"]["id"] == str(task.public_id)
    assert payload["data"]["task"]["status"] == "succeeded"
    assert set(payload["data"]["task"]) == set(TaskSerializer.Meta.fields), "the API's public task shape, no more"
    assert payload["data"]["event"]["kind"] == "succeeded"
    [row] = deliveries()
    assert (row.status, row.attempts, row.webhook_id) == (D.DELIVERED, 1, message.webhook_id)
    assert str(row.endpoint.public_id) == endpoint["id"]

    # Kicks are hints: more of them, and a sweep, send nothing twice.
    outbox.kick_due(clock.now() + LATER, limit=100)
    with later():
        webhook_jobs.sweep()
        assert set(run_webhook_kicks()) <= {"nothing"}
    assert len(receiver.received) == 1


def test_it_sends_nothing_for_events_the_endpoint_did_not_ask_for(acme, alice, alice_api, receiver):
    listen(alice_api, receiver, ["task.failed"])
    finish(submit_sleep(acme, alice, steps=1))
    assert run_webhook_kicks() == []
    assert not Delivery.objects.exists() and not receiver.received


def test_it_retries_while_the_receiver_is_down_and_delivers_once_it_is_up(acme, alice, alice_api, receiver):
    listen(alice_api, receiver)
    receiver.down()
    finish(submit_sleep(acme, alice, steps=1))

    assert run_webhook_kicks() == ["retry"]
    [row] = deliveries()
    assert (row.status, row.attempts) == (D.RETRY, 1)
    assert "could not connect" in row.last_error
    assert run_webhook_kicks() == [], "not due again before its backoff"

    receiver.up()
    with later():
        assert run_webhook_kicks() == ["delivered"]
    [message] = receiver.accepted()
    row.refresh_from_db()
    assert (row.status, row.attempts, row.last_error) == (D.DELIVERED, 2, "")
    assert message.webhook_id == row.webhook_id


def test_a_receiver_that_always_fails_dead_letters_the_delivery_with_an_alert(acme, alice, alice_api, receiver):
    listen(alice_api, receiver)
    receiver.answer_with(500)
    task = finish(submit_sleep(acme, alice, steps=1))

    assert run_webhook_kicks() == ["retry"]
    with later():
        assert run_webhook_kicks() == ["retry"]
        with later():
            assert run_webhook_kicks() == ["dead_letter"]
    [row] = deliveries()
    assert (row.status, row.attempts, row.last_status_code) == (D.DEAD_LETTER, 3, 500)
    assert len(receiver.received) == 3
    assert {r.webhook_id for r in receiver.received} == {row.webhook_id}, "one message id on every attempt"
    [alert] = Alert.objects.filter(kind=Alert.Kind.DEAD_LETTER)
    assert alert.task_id == task.pk and alert.tenant_id == acme.pk
    assert "webhook task.succeeded" in alert.message

    with later(LATER * 10):
        assert run_webhook_kicks() == [], "a dead letter is left alone"


def test_an_operator_retries_a_dead_letter_from_the_admin(acme, alice, alice_api, receiver, client):
    listen(alice_api, receiver)
    receiver.answer_with(500)
    finish(submit_sleep(acme, alice, steps=1))
    run_webhook_kicks()
    with later():
        run_webhook_kicks()
        with later():
            run_webhook_kicks()
    [row] = deliveries(status=D.DEAD_LETTER)

    operator = make_user("olga", acme, role=Membership.Role.ADMIN)
    operator.is_staff = True
    operator.save()
    from django.contrib.auth.models import Permission

    operator.user_permissions.add(Permission.objects.get(codename="change_delivery"),
                                  Permission.objects.get(codename="view_delivery"))
    client.force_login(operator)
    receiver.answer_with(None)
    response = client.post("/admin/webhooks/delivery/", {"action": "retry_dead_letters",
                                                         "_selected_action": [row.pk]})
    assert response.status_code == 302
    row.refresh_from_db()
    assert (row.status, row.attempts) == (D.PENDING, 0)
    assert AuditEntry.objects.filter(action="webhook.delivery_retried", actor=operator).exists()
    assert run_webhook_kicks() == ["delivered"]
    assert [m.webhook_id for m in receiver.accepted()] == [row.webhook_id]


def test_a_refused_address_dead_letters_at_once(acme, alice, alice_api, receiver, settings):
    listen(alice_api, receiver)
    settings.LONGHAUL_ALLOW_PRIVATE_FETCH = False  # e.g. the deployment turned it off since
    finish(submit_sleep(acme, alice, steps=1))
    assert run_webhook_kicks() == ["dead_letter"]
    [row] = deliveries()
    assert "loopback" in row.last_error
    assert not receiver.received


def test_a_newer_event_supersedes_an_undelivered_older_one(acme, alice, alice_api, receiver):
    listen(alice_api, receiver, ["task.partial", "task.succeeded"])
    receiver.down()
    task = make_task(acme, alice, status=TaskStatus.RUNNING)
    with transaction.atomic():
        append(task, [NewEvent("partial", {"scope": "half"})], status=task.status, at=clock.now())
    assert run_webhook_kicks() == ["retry"]
    with transaction.atomic():
        append(task, [NewEvent("succeeded")], status=task.status, at=clock.now())
    older, newer = deliveries()
    assert (older.status, newer.status) == (D.SUPERSEDED, D.PENDING)

    receiver.up()
    with later():
        assert sorted(run_webhook_kicks()) == ["delivered", "nothing"]  # the older one's kick finds nothing
    assert [m.payload["type"] for m in receiver.accepted()] == ["task.succeeded"]


def test_a_disabled_endpoint_holds_its_deliveries_until_enabled(acme, alice, alice_api, receiver):
    endpoint = listen(alice_api, receiver)
    task = make_task(acme, alice, status=TaskStatus.RUNNING)
    with transaction.atomic():
        append(task, [NewEvent("succeeded")], status=task.status, at=clock.now())
    response = alice_api.patch(f"/api/webhooks/{endpoint['id']}", {"enabled": False}, format="json")
    assert response.status_code == 200 and response.json()["enabled"] is False
    with later():
        webhook_jobs.sweep()
        assert set(run_webhook_kicks()) <= {"nothing"}
    assert not receiver.received
    assert alice_api.patch(f"/api/webhooks/{endpoint['id']}", {"enabled": True}, format="json").status_code == 200
    assert "delivered" in run_webhook_kicks()
    assert len(receiver.accepted()) == 1


# --- signatures ----------------------------------------------------------------------


def test_a_tampered_signature_fails_verification(acme, alice, alice_api, receiver):
    listen(alice_api, receiver)
    finish(submit_sleep(acme, alice, steps=1))
    run_webhook_kicks()
    [genuine] = receiver.received
    secret = receiver.secrets[0]
    Webhook(secret).verify(genuine.body, genuine.headers)  # the genuine one verifies

    tampered_body = genuine.body.replace('"succeeded"', '"failed"')
    with pytest.raises(WebhookVerificationError):
        Webhook(secret).verify(tampered_body, genuine.headers)
    forged = {**genuine.headers, "webhook-signature": "v1," + "A" * 43 + "="}
    with pytest.raises(WebhookVerificationError):
        Webhook(secret).verify(genuine.body, forged)
    with pytest.raises(WebhookVerificationError):
        Webhook(signing.new_secret()).verify(genuine.body, genuine.headers)

    # Sent over the wire, the receiver refuses the tampered copy.
    import httpx2

    signed = {name: genuine.headers[name] for name in ("webhook-id", "webhook-timestamp", "webhook-signature")}
    answer = httpx2.post(receiver.url + "/hook", content=tampered_body.encode(), headers=signed)
    assert answer.status_code == 401
    assert receiver.received[-1].verified_by == []


def test_during_a_rotation_overlap_both_signatures_are_sent(acme, alice, alice_api, receiver, settings):
    settings.LONGHAUL_WEBHOOK_SECRET_OVERLAP_SECONDS = 3600
    endpoint = listen(alice_api, receiver)
    old_secret = endpoint["secret"]
    response = alice_api.post(f"/api/webhooks/{endpoint['id']}/rotate-secret")
    assert response.status_code == 200
    new_secret = response.json()["secret"]
    assert new_secret != old_secret and new_secret.startswith("whsec_")
    assert "secret" not in alice_api.get(f"/api/webhooks/{endpoint['id']}").json(), "shown once"
    receiver.secrets.append(new_secret)

    task = make_task(acme, alice, status=TaskStatus.RUNNING)
    with transaction.atomic():
        append(task, [NewEvent("partial")], status=task.status, at=clock.now())
    Endpoint.objects.filter(public_id=endpoint["id"]).update(events=["task.partial", "task.succeeded"])
    with transaction.atomic():
        append(task, [NewEvent("partial")], status=task.status, at=clock.now())
    assert run_webhook_kicks() == ["delivered"]
    [message] = receiver.accepted()
    assert len(message.signatures) == 2
    assert message.verified_by == [0, 1], "a receiver with either secret accepts it"

    with later(timedelta(hours=2)):  # the overlap is over: only the new secret signs
        with transaction.atomic():
            append(task, [NewEvent("succeeded")], status=task.status, at=clock.now())
        assert run_webhook_kicks() == ["delivered"]
        last = receiver.accepted()[-1]
        assert len(last.signatures) == 1
        assert verified_by([old_secret, new_secret], last.body, last.headers) == [1]


# --- tenancy and registration ----------------------------------------------------------


def test_another_tenants_endpoint_never_receives_a_task(acme, globex, alice, bob, charlie, alice_api, charlie_api):
    with WebhookReceiver() as alices, WebhookReceiver() as bobs, WebhookReceiver() as charlies, \
            WebhookReceiver() as admins:
        listen(alice_api, alices)
        listen(api_client_for(bob), bobs)
        listen(charlie_api, charlies)
        dora = make_user("dora", acme, role=Membership.Role.ADMIN)
        admin_endpoint = listen(api_client_for(dora), admins)
        assert admin_endpoint["scope"] == "tenant"
        finish(submit_sleep(acme, alice, steps=1))
        finish(submit_sleep(globex, charlie, steps=1))
        run_webhook_kicks()

        alice_tasks = {m.payload["data"]["task"]["id"] for m in alices.accepted()}
        charlie_tasks = {m.payload["data"]["task"]["id"] for m in charlies.accepted()}
        assert len(alice_tasks) == 1 and len(charlie_tasks) == 1 and alice_tasks != charlie_tasks
        assert not bobs.received, "a member's endpoint hears of their own tasks only"
        assert {m.payload["data"]["task"]["id"] for m in admins.accepted()} == alice_tasks, "the tenant's, not globex's"
    charlie_endpoint = Endpoint.objects.get(tenant=globex)
    assert not Delivery.objects.filter(endpoint=charlie_endpoint, task__tenant=acme).exists()


def test_endpoints_are_listed_and_deleted_within_the_caller_scope(acme, alice, alice_api, charlie_api, receiver):
    endpoint = listen(alice_api, receiver)
    listing = alice_api.get("/api/webhooks").json()["results"]
    assert [e["id"] for e in listing] == [endpoint["id"]]
    assert "secret" not in listing[0]
    assert charlie_api.get("/api/webhooks").json()["results"] == []
    assert charlie_api.get(f"/api/webhooks/{endpoint['id']}").status_code == 404
    assert charlie_api.delete(f"/api/webhooks/{endpoint['id']}").status_code == 404
    assert charlie_api.post(f"/api/webhooks/{endpoint['id']}/rotate-secret").status_code == 404
    assert api_client_for(User.objects.create_user("eve")).get("/api/webhooks").status_code == 403

    assert alice_api.delete(f"/api/webhooks/{endpoint['id']}").status_code == 204
    assert not Endpoint.objects.exists()
    assert AuditEntry.objects.filter(action="webhook.removed", actor=alice).exists()
    finish(submit_sleep(acme, alice, steps=1))
    assert run_webhook_kicks() == [] and not receiver.received


def test_a_private_url_is_refused_at_registration_unless_private_fetch_is_allowed(alice_api, receiver, settings):
    settings.LONGHAUL_ALLOW_PRIVATE_FETCH = False
    for url in (receiver.url + "/hook", "http://10.0.0.7/hook", "http://[::1]:9/hook", "http://localhost:9/hook"):
        response = alice_api.post("/api/webhooks", {"url": url, "events": ["task.failed"]}, format="json")
        assert response.status_code == 400, url
        assert response.json()["field"] == "url"

    settings.LONGHAUL_ALLOW_PRIVATE_FETCH = True
    register(alice_api, receiver.url + "/hook")
    for url in ("http://169.254.169.254/latest/meta-data", "ftp://127.0.0.1/x", "http://user:pw@127.0.0.1/x",
                "not a url"):
        response = alice_api.post("/api/webhooks", {"url": url, "events": ["task.failed"]}, format="json")
        assert response.status_code == 400, url
        assert response.json()["field"] == "url"


def test_registration_names_the_bad_field(alice_api, receiver, settings):
    response = alice_api.post("/api/webhooks", {"url": receiver.url, "events": ["task.exploded"]}, format="json")
    assert response.status_code == 400 and response.json()["field"].startswith("events")
    response = alice_api.post("/api/webhooks", {"url": receiver.url, "events": []}, format="json")
    assert response.status_code == 400 and response.json()["field"].startswith("events")
    settings.LONGHAUL_WEBHOOK_MAX_ENDPOINTS = 1
    register(alice_api, receiver.url)
    response = alice_api.post("/api/webhooks", {"url": receiver.url, "events": ["task.failed"]}, format="json")
    assert response.status_code == 409 and response.json()["code"] == "too_many_webhooks"


# --- crashes and races --------------------------------------------------------------------


def test_a_worker_killed_mid_delivery_loses_nothing(acme, alice, alice_api, receiver):
    listen(alice_api, receiver)
    finish(submit_sleep(acme, alice, steps=1))
    OrmQ.objects.all().delete()  # the kick was taken by the worker about to die
    [row] = deliveries()

    # The worker claims the row and its request reaches the receiver; then it is killed before recording.
    claimed = outbox.claim(row.pk, owner="doomed:1", now=clock.now())
    headers = signing.headers(message_id=claimed.webhook_id, at=clock.now(), body=claimed.body,
                              signing_secrets=claimed.signing_secrets)
    async_to_sync(sender.post)(claimed.url, body=claimed.body, headers=headers)
    assert run_webhook_kicks() == [] and webhook_jobs.sweep() == 0, "its lease still holds the row"

    with later(timedelta(seconds=120)):  # the lease expired: the watchdog's kick finds the row
        assert run_webhook_kicks() == ["delivered"]
    row.refresh_from_db()
    assert (row.status, row.attempts) == (D.DELIVERED, 2)
    first, second = receiver.accepted()
    assert first.webhook_id == second.webhook_id == row.webhook_id, "receivers dedupe on the stable id"
    assert first.body == second.body


def test_a_delivery_whose_deliverer_keeps_dying_is_dead_lettered_not_looped(acme, alice, alice_api, receiver):
    listen(alice_api, receiver)
    finish(submit_sleep(acme, alice, steps=1))
    [row] = deliveries()
    for n in range(3):
        with later(timedelta(minutes=5 * (n + 1))):
            assert outbox.claim(row.pk, owner=f"doomed:{n}", now=clock.now()) is not None
    with later(timedelta(minutes=30)):
        assert outbox.claim(row.pk, owner="next:1", now=clock.now()) is None
    row.refresh_from_db()
    assert row.status == D.DEAD_LETTER
    assert Alert.objects.filter(kind=Alert.Kind.DEAD_LETTER, task=row.task).exists()


@pytest.mark.django_db(transaction=True)  # the lock is held on a connection of its own
def test_a_delivery_kick_that_meets_its_row_locked_for_a_moment_still_delivers(acme, alice, alice_api, receiver):
    """The kick is the row's only hint: skipped because another transaction held the row for a moment,
    the webhook would wait for the sweeper's next pass."""
    from tests.integration.test_kicks_not_lost import row_locked_elsewhere

    listen(alice_api, receiver)
    finish(submit_sleep(acme, alice, steps=1))
    [row] = deliveries()
    with row_locked_elsewhere(row):
        claimed = outbox.claim(row.pk, owner="a:1", now=clock.now())
    assert claimed is not None, "the kick was dropped"


def test_two_deliverers_racing_for_a_row_one_wins(acme, alice, alice_api, receiver):
    listen(alice_api, receiver)
    finish(submit_sleep(acme, alice, steps=1))
    [row] = deliveries()
    now = clock.now()
    first = outbox.claim(row.pk, owner="a:1", now=now)
    assert first is not None
    assert outbox.claim(row.pk, owner="b:2", now=now) is None

    with later(timedelta(seconds=120)):  # a's lease expired and b took over
        second = outbox.claim(row.pk, owner="b:2", now=clock.now())
        assert second is not None and second.webhook_id == first.webhook_id
        assert not outbox.delivered(first, "a:1", status_code=200, now=clock.now()), "the zombie records nothing"
        assert outbox.fail(first, "a:1", "late", status_code=500, permanent=False, now=clock.now()) == "lost"
        assert outbox.delivered(second, "b:2", status_code=200, now=clock.now())


def test_the_sweep_rekicks_a_delivery_whose_kick_was_lost(acme, alice, alice_api, receiver):
    listen(alice_api, receiver)
    finish(submit_sleep(acme, alice, steps=1))
    OrmQ.objects.all().delete()
    with later(timedelta(minutes=1)):
        assert webhook_jobs.sweep() == 1
        assert run_webhook_kicks() == ["delivered"]
    assert len(receiver.accepted()) == 1


def test_a_failure_while_queueing_never_undoes_the_task_transition(acme, alice, alice_api, receiver, monkeypatch):
    listen(alice_api, receiver, ["task.cancelled"])

    def broken(*args, **kwargs):
        raise RuntimeError("payload bug")

    monkeypatch.setattr("webhooks.payloads.body", broken)
    task = make_task(acme, alice, status=TaskStatus.RUNNING)
    with transaction.atomic():
        assert transitions.cancel(task, now=clock.now())
    task.refresh_from_db()
    assert task.status == TaskStatus.CANCELLED and task.events.filter(kind="cancelled").exists()
    assert not Delivery.objects.exists()
    assert Alert.objects.filter(kind=Alert.Kind.DEAD_LETTER, message__contains="could not be queued").exists()


def test_a_delivery_in_flight_when_a_newer_event_arrives_is_superseded_if_it_fails(acme, alice, alice_api, receiver):
    listen(alice_api, receiver, ["task.partial", "task.succeeded"])
    task = make_task(acme, alice, status=TaskStatus.RUNNING)
    with transaction.atomic():
        append(task, [NewEvent("partial")], status=task.status, at=clock.now())
    [older] = deliveries()
    claimed = outbox.claim(older.pk, owner="a:1", now=clock.now())
    with transaction.atomic():
        append(task, [NewEvent("succeeded")], status=task.status, at=clock.now())
    older.refresh_from_db()
    assert older.status == D.CLAIMED, "a row in flight is not taken from its deliverer"
    assert outbox.fail(claimed, "a:1", "HTTP 503", status_code=503, permanent=False, now=clock.now()) == "superseded"
    assert sorted(run_webhook_kicks()) == ["delivered", "nothing"]  # the older one's first kick finds nothing
    assert [m.payload["type"] for m in receiver.accepted()] == ["task.succeeded"]


def test_an_operator_registers_an_endpoint_in_the_admin_and_sees_its_secret_once(acme, globex, receiver, client):
    operator = make_user("olga", acme, role=Membership.Role.ADMIN)
    operator.is_staff = True
    operator.save()
    from django.contrib.auth.models import Permission

    operator.user_permissions.add(*Permission.objects.filter(codename__in=["add_endpoint", "change_endpoint",
                                                                           "view_endpoint"]))
    client.force_login(operator)
    form = {"tenant": globex.pk, "url": receiver.url + "/hook", "events": ["task.failed"], "enabled": "on"}
    assert client.post("/admin/webhooks/endpoint/add/", form).status_code == 200, "another tenant is not offered"
    assert not Endpoint.objects.exists()

    response = client.post("/admin/webhooks/endpoint/add/", {**form, "tenant": acme.pk}, follow=True)
    endpoint = Endpoint.objects.get()
    assert (endpoint.tenant, endpoint.owner, endpoint.created_by) == (acme, None, operator)
    assert endpoint.secret in response.content.decode()
    change_page = client.get(f"/admin/webhooks/endpoint/{endpoint.pk}/change/").content.decode()
    assert endpoint.secret not in change_page
    assert AuditEntry.objects.filter(action="webhook.registered", actor=operator).exists()



def test_an_answer_whose_body_does_not_decode_is_judged_by_its_status(receiver):
    """A receiver's answer is read for its message only: a body that says it is gzip-encoded and is not must not
    turn a delivery into a crash, nor hide the status."""
    receiver.broken_encoding = True
    receiver.answer_with(200)
    assert async_to_sync(sender.post)(receiver.url + "/hook", body='{"a": 1}', headers={}).status_code == 200

    receiver.answer_with(500)
    with pytest.raises(sender.SendFailed) as failed:
        async_to_sync(sender.post)(receiver.url + "/hook", body='{"a": 1}', headers={})
    assert str(failed.value) == "answered HTTP 500: (a body that does not decode)"
