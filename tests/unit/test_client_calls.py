"""What the client sends, decided before anything is sent: URLs, keys, name matching, exit codes."""

from __future__ import annotations

import pytest

from longhaul import calls
from longhaul.calls import Settings
from longhaul.client import AmbiguousName, NotFound, match_name
from longhaul.display import result_markdown
from longhaul.errors import AuthenticationFailed, ConnectionFailed, InvalidRequest, NotSignedIn, ServerError
from longhaul.outcomes import Exit, for_error, for_status

pytestmark = pytest.mark.smoke


@pytest.mark.parametrize("given", ["http://host:8000", "http://host:8000/", "http://host:8000/api/", "host:8000"])
def test_it_takes_the_server_root_however_it_is_written(given):
    assert Settings(given).url == "http://host:8000"
    assert Settings(given).api_url == "http://host:8000/api"


def test_it_streams_from_the_same_host_over_ws_or_wss():
    assert Settings("http://h:8000").stream_url("5b0e", 7) == "ws://h:8000/ws/tasks/5b0e/?after=7"
    assert (Settings("https://h", tenant="acme co").stream_url("5b0e", 0)
            == "wss://h/ws/tasks/5b0e/?after=0&tenant=acme%20co")


def test_it_keeps_a_typed_id_inside_the_task_routes():
    assert calls.events("../threads", after=0, limit=None).path == "/tasks/..%2Fthreads/events"


def test_it_makes_one_idempotency_key_per_submit_and_keeps_it_for_that_call():
    first = calls.submit("research", {"question": "q"}, name=None, budget=None, priority=None, thread=None,
                         idempotency_key=None)
    second = calls.submit("research", {"question": "q"}, name=None, budget=None, priority=None, thread=None,
                          idempotency_key=None)
    assert first.headers["Idempotency-Key"] != second.headers["Idempotency-Key"]
    assert first.request_args()["headers"] == first.request_args()["headers"]  # what each retry sends
    assert first.resend_safe


def test_it_sends_only_what_the_caller_gave():
    call = calls.submit("mcp", {"server": "s"}, name="n", budget=None, priority=None, thread=None,
                        idempotency_key="k-1")
    assert call.body == {"kind": "mcp", "input": {"server": "s"}, "name": "n"}
    assert call.headers == {"Idempotency-Key": "k-1"}


def test_it_passes_a_structured_answer_through_as_given():
    form = {"action": "accept", "content": {"approve": True, "note": "ok"}}
    assert calls.answer("t", form).body == {"answer": form}
    assert calls.answer("t", "yes").body == {"answer": "yes"}
    assert not calls.answer("t", "yes").resend_safe


def test_it_resends_only_what_a_repeat_cannot_double():
    assert calls.cancel("t", reason="", keep_results=False).resend_safe
    assert not calls.resume("t", budget=None).resend_safe
    assert not calls.delete("t").resend_safe


def test_it_reads_the_cursor_of_the_next_page():
    assert calls.next_cursor({"next": "http://h/api/tasks?cursor=cD0x&limit=200"}) == "cD0x"
    assert calls.next_cursor({"next": None}) is None


def test_it_backs_off_doubling_up_to_a_cap():
    settings = Settings("h", backoff=0.5)
    assert [settings.backoff_delay(n) for n in range(6)] == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0]


TASKS = [{"id": "a", "name": "Nightly digest", "status": "running"},
         {"id": "b", "name": "nightly digest", "status": "queued"},
         {"id": "c", "name": "weekly", "status": "running"},
         {"id": "d", "name": "Weekly", "status": "running"}]


def test_it_matches_a_name_exactly_before_ignoring_case():
    assert match_name("weekly", TASKS)["id"] == "c"
    assert match_name("WEEKLY", TASKS[2:3])["id"] == "c"


def test_it_refuses_a_name_that_matches_several_tasks():
    with pytest.raises(AmbiguousName) as raised:
        match_name("NIGHTLY DIGEST", TASKS)
    assert [t["id"] for t in raised.value.candidates] == ["a", "b"]


def test_it_says_not_found_for_a_name_nobody_has():
    with pytest.raises(NotFound) as raised:
        match_name("monthly", TASKS)
    assert raised.value.code == "not_found"


@pytest.mark.parametrize(("status", "code"), [
    ("succeeded", Exit.OK), ("failed", Exit.TASK_FAILED), ("cancelled", Exit.TASK_CANCELLED),
    ("partial", Exit.TASK_PARTIAL), ("waiting_input", Exit.NEEDS_PERSON), ("paused", Exit.NEEDS_PERSON),
])
def test_it_exits_with_the_code_of_the_outcome(status, code):
    assert for_status(status) == code


@pytest.mark.parametrize(("error", "code"), [
    (NotSignedIn("x"), Exit.NOT_SIGNED_IN),
    (AuthenticationFailed("x", status=401), Exit.NOT_SIGNED_IN),
    (NotFound("x", status=404), Exit.NOT_FOUND),
    (AmbiguousName("n", []), Exit.USAGE),
    (InvalidRequest("x", status=400), Exit.REFUSED),
    (ConnectionFailed("x"), Exit.UNREACHABLE),
    (ServerError("x", status=500), Exit.UNREACHABLE),
])
def test_it_exits_with_the_code_of_the_error(error, code):
    assert for_error(error) == code


def test_it_prints_a_report_as_written_and_anything_else_as_json():
    assert result_markdown({"report": "# Q\n"}) == "# Q\n"
    assert result_markdown({"content": [{"type": "text", "text": "done"}]}) == "done\n"
    assert result_markdown({"rows": 3}) == '```json\n{\n  "rows": 3\n}\n```\n'
