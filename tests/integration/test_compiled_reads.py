"""A read compiled once per process (tasks/compiled.py) answers each call as the ORM would have for that
call's values, converted as the ORM converts them, builds its statement once, and refuses what it could not
send faithfully: an argument that does not reach the SQL as a parameter of its own, or that shapes the
statement beyond its parameters, a flag, arguments by position."""

from __future__ import annotations

from datetime import datetime, timedelta

import pytest
from django.db.models import Count, QuerySet

from tasks import clock
from tasks.compiled import compiled_once
from tasks.models import Task
from tasks.statuses import TaskStatus
from tests.factories import make_task

pytestmark = pytest.mark.django_db
NOW = clock.now()


def due_by(*, name: str, now: datetime, at_least: int) -> QuerySet:
    return (Task.objects.filter(name=name, next_run_at__lte=now, priority__gte=at_least)
            .order_by("id").values_list("id", "priority"))


@pytest.mark.smoke
def test_each_call_answers_as_the_orm_does_for_its_own_values_from_one_build(acme, alice):
    now = clock.now()
    for name in ("a", "b"):
        for minutes, priority in ((-5, 0), (-1, 2), (5, 1)):
            make_task(acme, alice, name=name, next_run_at=now + timedelta(minutes=minutes), priority=priority)
    builds = []

    @compiled_once
    def read(*, name: str, now: datetime, at_least: int) -> QuerySet:
        builds.append(name)
        return due_by(name=name, now=now, at_least=at_least)

    asked = [dict(name=name, now=now + timedelta(minutes=shift), at_least=at_least)
             for name in ("a", "b", "c") for shift in (-3, 0, 10) for at_least in (0, 1, 2)]
    answers = [read(**values) for values in asked]
    assert answers == [list(due_by(**values)) for values in asked]
    assert {len(answer) for answer in answers} == {0, 1, 2, 3}, "the values chose different rows"
    assert len(builds) == 2 and all("stand-in" in name for name in builds), "built when compiled (twice), not again"


def test_its_columns_come_converted_as_the_orm_converts_them(acme, alice):
    make_task(acme, alice, name="a", budget={"max_steps": 7}, priority=2)
    read = compiled_once(lambda *, name: Task.objects.filter(name=name).values_list("budget", "created_at")
                         .annotate(n=Count("*")).values_list("budget", "created_at", "n"))
    assert read(name="a") == list(Task.objects.filter(name="a").values_list("budget", "created_at")
                                  .annotate(n=Count("*")).values_list("budget", "created_at", "n"))
    assert read(name="a")[0][0] == {"max_steps": 7}


@pytest.mark.parametrize("build, arguments, refusal", [
    (lambda *, now: Task.objects.filter(next_run_at__lte=now - timedelta(seconds=1)).values_list("id"),
     {"now": NOW}, "now does not reach the SQL as a parameter of its own"),
    (lambda *, name: Task.objects.filter(name__contains=name).values_list("id"),
     {"name": "a"}, "name does not reach the SQL as a parameter of its own"),
    # One value, or two, as the value is even or odd: its SQL has one placeholder or two.
    (lambda *, at_least: Task.objects.filter(priority__in=[at_least, at_least + 1][:1 + at_least % 2])
     .values_list("id"),
     {"at_least": 1}, "its statement changes with its values beyond their parameters"),
])
def test_a_read_it_could_not_send_faithfully_is_refused_when_compiled(acme, alice, build, arguments, refusal):
    make_task(acme, alice, name="a", status=TaskStatus.QUEUED)
    with pytest.raises(TypeError, match=refusal):
        compiled_once(build)(**arguments)


def test_a_flag_and_arguments_by_position_are_refused(acme, alice):
    read = compiled_once(lambda *, done: Task.objects.filter(status=TaskStatus.SUCCEEDED).values_list("id"))
    with pytest.raises(TypeError, match="a flag changes the statement's shape"):
        read(done=True)
    positional = compiled_once(lambda name: Task.objects.filter(name=name).values_list("id"))
    with pytest.raises(TypeError, match="arguments by keyword only"):
        positional("a")


def test_a_call_with_other_arguments_than_it_was_compiled_for_is_refused(acme, alice):
    read = compiled_once(lambda **values: Task.objects.filter(**values).values_list("id"))
    assert read(name="a") == []
    with pytest.raises(TypeError, match=r"called with \['kind'\], compiled for \['name'\]"):
        read(kind="sleep")


def test_an_argument_that_shapes_the_statement_gets_a_statement_for_each_of_its_values(acme, alice):
    for priority in range(5):
        make_task(acme, alice, name="a", priority=priority)
    builds = []

    @compiled_once(shaped_by=("limit",))
    def first(*, name: str, limit: int) -> QuerySet:
        builds.append(limit)
        return Task.objects.filter(name=name).order_by("priority").values_list("priority")[:limit]

    assert [first(name="a", limit=limit) for limit in (2, 3, 2)] == [[(0,), (1,)], [(0,), (1,), (2,)], [(0,), (1,)]]
    assert first(name="b", limit=3) == []
    assert builds == [2, 2, 3, 3], "built twice when compiled for each limit, never again"
    with pytest.raises(TypeError, match=r"called without \['limit'\]"):
        first(name="a")
    assert first(name="a", limit=None) == [(n,) for n in range(5)]
    with pytest.raises(TypeError, match=r"called without \['limit'\]"):
        first(name="a")  # not taken for the statement without a limit compiled just now


def test_an_argument_that_shapes_the_statement_unnamed_as_such_is_refused(acme, alice):
    read = compiled_once(lambda *, limit: Task.objects.order_by("id").values_list("id")[:limit])
    with pytest.raises(TypeError, match="limit does not reach the SQL as a parameter of its own"):
        read(limit=2)
    with pytest.raises(TypeError, match="a tuple of argument names"):
        compiled_once(shaped_by="limit")
