"""An MCP elicitation's requested schema as a form, and the user's answer as the inputResponse to send.

Pure functions, no I/O: the `mcp` driver builds responses with them and the API validates answers
and describes the form's fields with them. The specification restricts a requested schema to a flat
object of primitive properties (string, number, integer, boolean, and string enums given as `enum`
or as `oneOf` consts); anything else (nested objects, arrays, multi-select) is `Unsupported`.

    fields(schema)            -> [Field, ...]
    response(schema, "pdf")   -> {"action": "accept", "content": {"format": "pdf"}}
    response(schema, {"action": "accept", "content": {"copies": "3", ...}})  # checked and coerced
    response(schema, {"action": "decline"}) -> {"action": "decline"}
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

FieldType = Literal["text", "number", "integer", "boolean", "choice"]
ACTIONS = ("accept", "decline", "cancel")
ORDER_KEY = "x-longhaul-order"  # our own key beside a stored schema: its properties in the order asked
TEXT_MAX_CHARS = 10_000  # a text field's limit when the schema sets none, as for a text answer
_TRUE = {"true", "yes", "on", "1"}
_FALSE = {"false", "no", "off", "0"}


class FormError(ValueError):
    """Base of the form errors; the message is meant for the user."""


class Unsupported(FormError):
    """The requested schema holds something a form cannot render (nested objects, arrays...)."""


class InvalidAnswer(FormError):
    """The answer does not fit the form; `field` names the offending field (None: the answer as a whole)."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class Field:
    name: str
    title: str
    description: str
    type: FieldType
    required: bool
    choices: tuple[str, ...] = ()
    minimum: float | None = None
    maximum: float | None = None
    max_length: int | None = None
    min_length: int | None = None
    choice_titles: tuple[str, ...] = ()  # parallel to `choices`: what to show for each

    def as_dict(self) -> dict[str, Any]:
        """The field for the API, JSON-safe."""
        return {"name": self.name, "title": self.title, "description": self.description, "type": self.type,
                "required": self.required, "choices": list(self.choices), "choice_titles": list(self.choice_titles),
                "minimum": self.minimum, "maximum": self.maximum, "max_length": self.max_length,
                "min_length": self.min_length}


def fields(schema: dict[str, Any] | None) -> list[Field]:
    """The form's fields in the schema's order; [] for no schema or one without properties."""
    if not schema:
        return []
    if not isinstance(schema, dict):
        raise Unsupported("the requested schema is not an object")
    if schema.get("type", "object") != "object":
        raise Unsupported(f"a requested schema of type {schema.get('type')!r} cannot be shown as a form")
    properties = schema.get("properties") or {}
    required = schema.get("required") or []
    if not isinstance(properties, dict) or not isinstance(required, list):
        raise Unsupported("the requested schema's properties or required list is malformed")
    order = schema.get(ORDER_KEY)
    names = [n for n in order if n in properties] if isinstance(order, list) else list(properties)
    return [_field(str(name), properties[name], required=name in required) for name in names]


def keeping_order(schema: dict[str, Any] | None) -> dict[str, Any] | None:
    """The schema as stored: PostgreSQL's jsonb sorts an object's keys, so the properties' order, the order
    a person fills the form in, is kept beside them."""
    if not schema or not isinstance(schema.get("properties"), dict) or ORDER_KEY in schema:
        return schema  # already kept (read back from the database, its properties are no longer in order)
    return {**schema, ORDER_KEY: list(schema["properties"])}


def response(schema: dict[str, Any] | None, answer: str | dict[str, Any]) -> dict[str, Any]:
    """The inputResponse for `answer`: free text for a one-text-field form, or an accept / decline / cancel."""
    form = fields(schema)
    if isinstance(answer, str):
        return {"action": "accept", "content": _content(form, {_text_target(form).name: answer})}
    if not isinstance(answer, dict):
        raise InvalidAnswer("an answer is text or an object with an action")
    unknown = sorted(set(answer) - {"action", "content"})
    if unknown:
        raise InvalidAnswer(f"an answer has no {unknown[0]!r}")
    action = answer.get("action")
    if action not in ACTIONS:
        raise InvalidAnswer("the action must be accept, decline or cancel")
    content = answer.get("content")
    if action != "accept":
        if content not in (None, {}):
            raise InvalidAnswer(f"a {action} carries no content")
        return {"action": action}
    if content is None:
        content = {}
    if not isinstance(content, dict):
        raise InvalidAnswer("the content must be an object of field values")
    return {"action": "accept", "content": _content(form, content)}


# --- schema -> fields ---------------------------------------------------------------------------


def _field(name: str, prop: Any, *, required: bool) -> Field:
    if not isinstance(prop, dict):
        raise Unsupported(f"field {name!r} is not described by an object")
    kind = prop.get("type")
    title = prop.get("title") if isinstance(prop.get("title"), str) and prop.get("title") else name
    description = prop.get("description") if isinstance(prop.get("description"), str) else ""
    common: dict[str, Any] = {"name": name, "title": title, "description": description, "required": required}
    if kind == "string" and ("enum" in prop or "oneOf" in prop):
        choices, titles = _choices(name, prop)
        return Field(type="choice", choices=choices, choice_titles=titles, **common)
    if kind == "string":
        return Field(type="text", max_length=_length(name, prop, "maxLength"),
                     min_length=_length(name, prop, "minLength"), **common)
    if kind in ("number", "integer"):
        return Field(type=kind, minimum=_bound(name, prop, "minimum"), maximum=_bound(name, prop, "maximum"), **common)
    if kind == "boolean":
        return Field(type="boolean", **common)
    raise Unsupported(f"field {name!r} of type {kind!r} cannot be shown in a form")


def _choices(name: str, prop: dict[str, Any]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    if "enum" in prop:
        values = prop["enum"]
        titles = prop.get("enumNames")  # the legacy spelling of titled choices
        if not isinstance(titles, list) or len(titles) != len(values) or not all(isinstance(t, str) for t in titles):
            titles = values
    else:
        options = prop["oneOf"]
        if not isinstance(options, list) or not all(isinstance(o, dict) and "const" in o for o in options):
            raise Unsupported(f"field {name!r}: its options are not a list of consts")
        values = [o["const"] for o in options]
        titles = [o.get("title") if isinstance(o.get("title"), str) else o["const"] for o in options]
    if not isinstance(values, list) or not values or not all(isinstance(v, str) for v in values):
        raise Unsupported(f"field {name!r}: its choices must be a non-empty list of strings")
    return tuple(values), tuple(str(t) for t in titles)


def _length(name: str, prop: dict[str, Any], key: str) -> int | None:
    value = prop.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise Unsupported(f"field {name!r}: {key} must be a whole number")
    return value


def _bound(name: str, prop: dict[str, Any], key: str) -> float | None:
    value = prop.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or isinstance(value, float) and not math.isfinite(value):
        raise Unsupported(f"field {name!r}: {key} must be a finite number")
    return value


# --- answer -> content --------------------------------------------------------------------------


def _text_target(form: list[Field]) -> Field:
    """The one field a free-text answer fills: the only text field, else the only required one."""
    texts = [f for f in form if f.type in ("text", "choice")]
    if len(texts) == 1:
        return texts[0]
    required = [f for f in texts if f.required]
    if len(required) == 1:
        return required[0]
    raise InvalidAnswer("this question is a form: answer its fields rather than with text")


def _content(form: list[Field], values: dict[str, Any]) -> dict[str, Any]:
    by_name = {f.name: f for f in form}
    unknown = sorted(str(name) for name in values if name not in by_name)
    if unknown:
        raise InvalidAnswer(f"the question has no field {unknown[0]!r}", unknown[0])
    content: dict[str, Any] = {}
    for f in form:
        value = values.get(f.name)
        if value is None or value == "":  # what a form sends for a field left empty
            if f.required:
                raise InvalidAnswer(f"{f.name} is required", f.name)
            continue
        content[f.name] = _value(f, value)
    return content


def _value(f: Field, value: Any) -> str | int | float | bool:
    match f.type:
        case "text":
            if not isinstance(value, str):
                raise InvalidAnswer(f"{f.name} must be text", f.name)
            max_length = f.max_length if f.max_length is not None else TEXT_MAX_CHARS
            if len(value) > max_length:
                raise InvalidAnswer(f"{f.name} must be at most {max_length} characters", f.name)
            if f.min_length is not None and len(value) < f.min_length:
                raise InvalidAnswer(f"{f.name} must be at least {f.min_length} characters", f.name)
            return value
        case "choice":
            if not isinstance(value, str) or value not in f.choices:
                raise InvalidAnswer(f"{f.name} must be one of {', '.join(f.choices)}", f.name)
            return value
        case "boolean":
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
                return value.strip().lower() in _TRUE
            raise InvalidAnswer(f"{f.name} must be yes or no", f.name)
        case _:
            return _number(f, value)


def _number(f: Field, value: Any) -> int | float:
    if isinstance(value, bool):
        raise InvalidAnswer(f"{f.name} must be a number", f.name)
    if isinstance(value, str):
        try:
            value = float(value.strip()) if value.strip() else None
        except ValueError:
            value = None
    if isinstance(value, float) and not math.isfinite(value) or not isinstance(value, int | float):
        raise InvalidAnswer(f"{f.name} must be a number", f.name)
    if f.type == "integer":
        if value != int(value):
            raise InvalidAnswer(f"{f.name} must be a whole number", f.name)
        value = int(value)
    if f.minimum is not None and value < f.minimum:
        raise InvalidAnswer(f"{f.name} must be at least {f.minimum:g}", f.name)
    if f.maximum is not None and value > f.maximum:
        raise InvalidAnswer(f"{f.name} must be at most {f.maximum:g}", f.name)
    return value
