"""Elicitation forms: a requested schema as fields, and an answer as the inputResponse to send."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tasks.mcp import forms
from tasks.mcp.forms import Field, InvalidAnswer, Unsupported

# The fake server's ask_many schema.
DETAILS = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "title": "Title", "description": "Shown on the cover", "maxLength": 80},
        "copies": {"type": "integer", "minimum": 1, "maximum": 10},
        "urgent": {"type": "boolean"},
        "format": {"type": "string", "enum": ["pdf", "html"]},
    },
    "required": ["title", "copies", "format"],
}
ONE_STRING = {"type": "object", "properties": {"format": {"type": "string"}}, "required": ["format"]}


def accept(content: dict[str, Any]) -> dict[str, Any]:
    return {"action": "accept", "content": content}


def test_it_reads_the_fields_of_a_flat_schema_in_order() -> None:
    title, copies, urgent, format_ = forms.fields(DETAILS)

    assert title == Field(name="title", title="Title", description="Shown on the cover", type="text", required=True,
                          max_length=80)
    assert (copies.type, copies.required, copies.minimum, copies.maximum) == ("integer", True, 1, 10)
    assert (urgent.type, urgent.required, urgent.title) == ("boolean", False, "urgent")
    assert (format_.type, format_.choices) == ("choice", ("pdf", "html"))


def test_it_reads_titled_choices_given_as_one_of_consts() -> None:
    schema = {"type": "object", "properties": {"size": {"type": "string", "oneOf": [
        {"const": "s", "title": "Small"}, {"const": "l", "title": "Large"}]}}}

    (size,) = forms.fields(schema)

    assert (size.type, size.choices, size.choice_titles) == ("choice", ("s", "l"), ("Small", "Large"))


def test_it_reads_a_number_field() -> None:
    (ratio,) = forms.fields({"type": "object", "properties": {"ratio": {"type": "number", "maximum": 1.5}}})

    assert (ratio.type, ratio.minimum, ratio.maximum, ratio.required) == ("number", None, 1.5, False)


@pytest.mark.parametrize("schema", [None, {}, {"type": "object"}, {"type": "object", "properties": {}}])
def test_it_has_no_fields_without_a_schema(schema: dict[str, Any] | None) -> None:
    assert forms.fields(schema) == []


def test_its_fields_are_json_safe_for_the_api() -> None:
    described = [f.as_dict() for f in forms.fields(DETAILS)]

    assert json.loads(json.dumps(described)) == described
    assert described[1] == {"name": "copies", "title": "copies", "description": "", "type": "integer",
                            "required": True, "choices": [], "choice_titles": [], "minimum": 1, "maximum": 10,
                            "max_length": None, "min_length": None}
    assert described[3]["choices"] == ["pdf", "html"]


@pytest.mark.parametrize("prop", [
    {"type": "object", "properties": {"x": {"type": "string"}}},
    {"type": "array", "items": {"type": "string", "enum": ["a", "b"]}},
    {"type": "null"},
    {"enum": ["a"]},
    {"type": "string", "enum": [1, 2]},
    {"type": "string", "oneOf": [{"title": "no const"}]},
    {"type": "integer", "minimum": "one"},
    "string",
])
def test_it_refuses_a_schema_a_form_cannot_render(prop: Any) -> None:
    with pytest.raises(Unsupported):
        forms.fields({"type": "object", "properties": {"x": prop}})


def test_it_refuses_a_schema_that_is_not_an_object() -> None:
    with pytest.raises(Unsupported):
        forms.fields({"type": "array", "items": {"type": "string"}})


def test_it_answers_the_single_string_field_with_free_text() -> None:
    assert forms.response(ONE_STRING, "pdf") == accept({"format": "pdf"})


def test_it_answers_the_one_required_string_field_with_free_text() -> None:
    schema = {"type": "object", "required": ["title"],
              "properties": {"note": {"type": "string"}, "count": {"type": "integer"}, "title": {"type": "string"}}}

    assert forms.response(schema, "Q3") == accept({"title": "Q3"})


def test_it_checks_free_text_against_its_field() -> None:
    schema = {"type": "object", "properties": {"format": {"type": "string", "enum": ["pdf", "html"]}}}

    assert forms.response(schema, "html") == accept({"format": "html"})
    with pytest.raises(InvalidAnswer, match="format must be one of pdf, html"):
        forms.response(schema, "doc")


@pytest.mark.parametrize("schema", [DETAILS | {"required": ["copies"]}, None,
                                    {"type": "object", "properties": {"n": {"type": "integer"}}}])
def test_it_refuses_free_text_for_a_question_without_one_string_to_fill(schema: dict[str, Any] | None) -> None:
    with pytest.raises(InvalidAnswer, match="answer its fields"):
        forms.response(schema, "3")


def test_free_text_still_needs_the_other_required_fields() -> None:
    schema = {"type": "object", "required": ["title", "copies"],
              "properties": {"title": {"type": "string"}, "copies": {"type": "integer"}}}

    with pytest.raises(InvalidAnswer, match="copies is required") as raised:
        forms.response(schema, "Quarterly report")
    assert raised.value.field == "copies"


def test_it_accepts_a_form_answer_coercing_what_a_form_sends() -> None:
    answer = accept({"title": "Q3", "copies": "3", "urgent": "true", "format": "pdf"})

    assert forms.response(DETAILS, answer) == accept({"title": "Q3", "copies": 3, "urgent": True, "format": "pdf"})


def test_it_leaves_out_optional_fields_left_empty() -> None:
    answer = accept({"title": "Q3", "copies": 2.0, "urgent": "", "format": "html"})

    assert forms.response(DETAILS, answer) == accept({"title": "Q3", "copies": 2, "format": "html"})


@pytest.mark.parametrize(("content", "field", "words"), [
    ({"copies": 3, "format": "pdf"}, "title", "title is required"),
    ({"title": "", "copies": 3, "format": "pdf"}, "title", "title is required"),
    ({"title": "x" * 81, "copies": 3, "format": "pdf"}, "title", "title must be at most 80 characters"),
    ({"title": 7, "copies": 3, "format": "pdf"}, "title", "title must be text"),
    ({"title": "Q3", "copies": 2.5, "format": "pdf"}, "copies", "copies must be a whole number"),
    ({"title": "Q3", "copies": "2.5", "format": "pdf"}, "copies", "copies must be a whole number"),
    ({"title": "Q3", "copies": "three", "format": "pdf"}, "copies", "copies must be a number"),
    ({"title": "Q3", "copies": True, "format": "pdf"}, "copies", "copies must be a number"),
    ({"title": "Q3", "copies": float("nan"), "format": "pdf"}, "copies", "copies must be a number"),
    ({"title": "Q3", "copies": "1e999", "format": "pdf"}, "copies", "copies must be a number"),
    ({"title": "Q3", "copies": float("inf"), "format": "pdf"}, "copies", "copies must be a number"),
    ({"title": "Q3", "copies": 0, "format": "pdf"}, "copies", "copies must be at least 1"),
    ({"title": "Q3", "copies": 11, "format": "pdf"}, "copies", "copies must be at most 10"),
    ({"title": "Q3", "copies": 3, "format": "doc"}, "format", "format must be one of pdf, html"),
    ({"title": "Q3", "copies": 3, "format": "pdf", "urgent": "maybe"}, "urgent", "urgent must be yes or no"),
    ({"title": "Q3", "copies": 3, "format": "pdf", "colour": "red"}, "colour", "no field 'colour'"),
])
def test_it_refuses_an_answer_that_does_not_fit_naming_the_field(content: dict[str, Any], field: str,
                                                                   words: str) -> None:
    with pytest.raises(InvalidAnswer, match=words) as raised:
        forms.response(DETAILS, accept(content))
    assert raised.value.field == field


def test_it_refuses_a_non_finite_number_field() -> None:
    schema = {"type": "object", "properties": {"ratio": {"type": "number"}}, "required": ["ratio"]}

    assert forms.response(schema, accept({"ratio": "0.25"})) == accept({"ratio": 0.25})
    for bad in (float("nan"), float("-inf"), "nan", "Infinity"):
        with pytest.raises(InvalidAnswer, match="ratio must be a number"):
            forms.response(schema, accept({"ratio": bad}))


@pytest.mark.parametrize("action", ["decline", "cancel"])
def test_decline_and_cancel_are_answers_too(action: str) -> None:
    assert forms.response(DETAILS, {"action": action}) == {"action": action}
    assert forms.response(None, {"action": action, "content": None}) == {"action": action}


def test_it_accepts_a_question_without_fields_with_empty_content() -> None:
    assert forms.response(None, {"action": "accept"}) == accept({})


@pytest.mark.parametrize("answer", [
    {"action": "maybe"}, {}, {"action": "accept", "content": ["pdf"]}, {"action": "decline", "content": {"a": 1}},
    {"action": "accept", "content": {}, "extra": 1}, 42,
])
def test_it_refuses_a_malformed_answer(answer: Any) -> None:
    with pytest.raises(InvalidAnswer):
        forms.response(DETAILS, answer)


def test_a_stored_schema_keeps_its_fields_in_the_order_asked() -> None:
    schema = {"type": "object", "properties": {"title": {"type": "string"}, "copies": {"type": "integer"},
                                               "urgent": {"type": "boolean"}}}
    stored = forms.keeping_order(schema)
    # What PostgreSQL's jsonb gives back: keys sorted shortest first.
    reread = {**stored, "properties": dict(sorted(stored["properties"].items(), key=lambda kv: (len(kv[0]), kv[0])))}
    assert [f.name for f in forms.fields(reread)] == ["title", "copies", "urgent"]
    assert forms.response(reread, {"action": "accept", "content": {"title": "t", "copies": 1}})["content"] == {
        "title": "t", "copies": 1}
    assert forms.keeping_order(None) is None


def test_a_text_field_without_max_length_takes_at_most_10000_characters() -> None:
    assert forms.response(ONE_STRING, accept({"format": "x" * 10_000})) == accept({"format": "x" * 10_000})
    for answer in (accept({"format": "x" * 10_001}), "x" * 10_001):
        with pytest.raises(InvalidAnswer, match="format must be at most 10000 characters") as raised:
            forms.response(ONE_STRING, answer)
        assert raised.value.field == "format"


def test_a_text_fields_own_max_length_is_its_limit() -> None:
    schema = {"type": "object", "properties": {"note": {"type": "string", "maxLength": 20_000}}}

    assert forms.response(schema, accept({"note": "x" * 15_000})) == accept({"note": "x" * 15_000})
