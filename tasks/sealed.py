"""Sealed columns: model fields whose content is stored encrypted with its tenant's key (tasks/crypto.py).

A sealed field holds plaintext in Python and a token in the database. A write must know the row's
tenant: `save()`, `create()` and `bulk_create()` find it from the row itself (`tenant` names the path,
"tenant_id", "task__tenant_id" or "thread__tenant_id"; a task's or thread's tenant never changes, so it
is looked up once per process); `QuerySet.update()` on SealedQuerySet finds it from the rows it
updates, and a caller that knows it passes `Sealed(tenant_id, value)` and saves that query. A
plaintext value that reaches the database any other way raises instead of being stored in the clear.

Reads open tokens; rows written before encryption (plain JSON or text) read as they are until
`rotate_tenant_key` seals them. Content whose key was destroyed reads as ERASED_TEXT, or as
ERASED_JSON for JSON columns; a token that fails its check raises crypto.TamperedContent.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

from django.apps import apps
from django.core.exceptions import FieldError, ImproperlyConfigured
from django.db import models, transaction
from django.db.models.expressions import BaseExpression
from django.db.models.lookups import Exact

from tasks.errors import TamperedContent

ERASED_TEXT = "[content erased]"
ERASED_JSON = {"content_erased": "This content was erased: its tenant's data key was destroyed."}
JSON_KEY = "lh_sealed"  # a sealed JSON value is stored as {"lh_sealed": token}


@dataclass(frozen=True)
class Sealed:
    """A value to store sealed for this tenant (for QuerySet.update() callers that know the tenant)."""

    tenant_id: int
    value: Any


class SealedFieldMixin:
    def __init__(self, *args: Any, tenant: str = "tenant_id", when: Callable[[Any], bool] | None = None,
                 **kwargs: Any) -> None:
        self.tenant_path = tenant
        self.when = when  # rows it is false for are stored in the clear (events without content)
        super().__init__(*args, **kwargs)

    def deconstruct(self) -> tuple:
        name, _, args, kwargs = super().deconstruct()  # type: ignore[misc]
        # Migrations see the plain field: sealing changes values, never the column.
        base = "django.db.models.JSONField" if isinstance(self, models.JSONField) else "django.db.models.TextField"
        return name, base, args, kwargs

    # Sealed values differ on every write (a fresh nonce), so SQL can test them for NULL and nothing else:
    # an equality, a containment or a key of a sealed value would quietly match nothing. Refused instead.
    # A field that leaves some rows in the clear (`when`) keeps its key lookups for those (metrics use them).
    def get_lookup(self, lookup_name: str) -> Any:
        if lookup_name == "isnull" or self.when is not None:
            return super().get_lookup(lookup_name)  # type: ignore[misc]
        if lookup_name == "exact":
            return _NullOnlyExact
        raise FieldError(f"{self.label} is sealed: SQL cannot compare or read into its content ({lookup_name}); "
                         "read the rows and compare in Python")

    def get_transform(self, lookup_name: str) -> Any:
        if self.when is not None:
            return super().get_transform(lookup_name)  # type: ignore[misc]
        raise FieldError(f"{self.label} is sealed: SQL cannot compare or read into its content ({lookup_name}); "
                         "read the rows and compare in Python")

    @property
    def label(self) -> str:
        return f"{self.model._meta.db_table}.{self.column}"  # type: ignore[attr-defined]

    def pre_save(self, model_instance: models.Model, add: bool) -> Any:
        value = super().pre_save(model_instance, add)  # type: ignore[misc]
        if value is None or isinstance(value, (Sealed, BaseExpression)):
            return value
        if self.when is not None and not self.when(model_instance):
            return _Clear(value)
        return Sealed(tenant_of(model_instance, self.tenant_path), value)

    def get_db_prep_save(self, value: Any, connection: Any) -> Any:
        from tasks import crypto  # crypto reads TenantKey, a model of the module these fields are used in

        if isinstance(value, _Clear):
            return super().get_db_prep_save(value.value, connection)  # type: ignore[misc]
        if isinstance(value, Sealed):
            if not crypto.enabled():
                return super().get_db_prep_save(value.value, connection)  # type: ignore[misc]
            token = crypto.seal(value.tenant_id, self.to_plaintext(value.value), label=self.label)
            return super().get_db_prep_save(self.stored(token), connection)  # type: ignore[misc]
        if value is None or isinstance(value, BaseExpression) or not crypto.enabled():
            return super().get_db_prep_save(value, connection)  # type: ignore[misc]
        raise ImproperlyConfigured(f"{self.label} is sealed: write it with save(), create(), or an update() "
                                   "through SealedQuerySet or with Sealed(tenant_id, value), never in the clear")

    def from_db_value(self, value: Any, expression: Any, connection: Any) -> Any:
        from tasks import crypto

        token = self.token_of(value)
        if token is None:
            return self.plain(value, expression, connection)
        tenant_id, opened = crypto.open_token(token, label=self.label)
        if opened is crypto.ERASED:
            return self.erased()
        return _owned(self.from_plaintext(opened), tenant_id)


class _NullOnlyExact(Exact):
    """`field=None` (Django turns it into IS NULL); any other value is refused."""

    def __init__(self, lhs: Any, rhs: Any) -> None:
        if rhs is not None:
            raise FieldError(f"{lhs.output_field.label} is sealed: SQL cannot compare its content (exact); "
                             "read the rows and compare in Python")
        super().__init__(lhs, rhs)


class _Clear:
    """A value a field's `when` leaves in the clear (pre_save's answer, so the write does not refuse it)."""

    def __init__(self, value: Any) -> None:
        self.value = value


class SealedJSONField(SealedFieldMixin, models.JSONField):
    def to_plaintext(self, value: Any) -> bytes:
        return json.dumps(value, cls=self.encoder, separators=(",", ":")).encode()

    def from_plaintext(self, plaintext: bytes) -> Any:
        return json.loads(plaintext, cls=self.decoder)

    def stored(self, token: str) -> dict[str, str]:
        return {JSON_KEY: token}

    def token_of(self, value: Any) -> str | None:
        # psycopg hands jsonb over as text; a sealed value is an object with the one key.
        if isinstance(value, str) and value.startswith('{"' + JSON_KEY):
            loaded = json.loads(value)
            if isinstance(loaded, dict) and set(loaded) == {JSON_KEY}:
                return loaded[JSON_KEY]
        if isinstance(value, dict) and set(value) == {JSON_KEY}:
            return value[JSON_KEY]
        return None

    def plain(self, value: Any, expression: Any, connection: Any) -> Any:
        return models.JSONField.from_db_value(self, value, expression, connection)

    def erased(self) -> Any:
        return dict(ERASED_JSON)


class SealedTextField(SealedFieldMixin, models.TextField):
    def to_plaintext(self, value: Any) -> bytes:
        return str(value).encode()

    def from_plaintext(self, plaintext: bytes) -> str:
        return plaintext.decode()

    def stored(self, token: str) -> str:
        return token

    def token_of(self, value: Any) -> str | None:
        from tasks import crypto

        return value if crypto.is_token(value) else None

    def plain(self, value: Any, expression: Any, connection: Any) -> Any:
        return value

    def erased(self) -> str:
        return ERASED_TEXT


def wrap(model: type[models.Model], tenant_id: int, values: dict[str, Any]) -> dict[str, Any]:
    """`values` for an update() of `model` rows of this tenant, its sealed fields wrapped in Sealed."""
    return {name: Sealed(tenant_id, value) if _needs_sealing(model, name, value) else value
            for name, value in values.items()}


def _needs_sealing(model: type[models.Model], name: str, value: Any) -> bool:
    return (isinstance(model._meta.get_field(name), SealedFieldMixin) and value is not None
            and not isinstance(value, (Sealed, BaseExpression)))


class _OwnedDict(dict):
    sealed_for: int


class _OwnedList(list):
    sealed_for: int


class _OwnedStr(str):
    sealed_for: int


def _owned(value: Any, tenant_id: int) -> Any:
    """The opened value, marked with the tenant whose key sealed it, for SealedModel.from_db to check."""
    kind = {dict: _OwnedDict, list: _OwnedList, str: _OwnedStr}.get(type(value))
    if kind is None:
        return value
    owned = kind(value)
    owned.sealed_for = tenant_id
    return owned


class SealedModel(models.Model):
    """A model with sealed columns: a row loaded with content sealed for another tenant than its own (a
    token copied across tenants in the database) is an error, not that tenant's content."""

    class Meta:
        abstract = True

    @classmethod
    def from_db(cls, db: str | None, field_names: Any, values: Any) -> Any:
        instance = super().from_db(db, field_names, values)
        for field in sealed_fields(cls):
            if field.attname in instance.__dict__:
                owner = getattr(instance.__dict__[field.attname], "sealed_for", None)
                if owner is not None and owner != tenant_of(instance, field.tenant_path):
                    raise TamperedContent(f"{field.label}: row {instance.pk} holds content sealed for another "
                                          "tenant; it was moved, and is not shown")
        return instance


@cache
def sealed_fields(model: type[models.Model]) -> tuple[SealedFieldMixin, ...]:
    return tuple(f for f in model._meta.concrete_fields if isinstance(f, SealedFieldMixin))


class SealedQuerySet(models.QuerySet):
    """update() seals the sealed fields it is given for the tenant of the rows it updates."""

    def update(self, **kwargs: Any) -> int:
        plain = {name: value for name, value in kwargs.items() if _needs_sealing(self.model, name, value)}
        if plain:
            paths = {self.model._meta.get_field(name).tenant_path for name in plain}
            (path,) = paths
            tenants = list(self.order_by().values_list(path, flat=True).distinct()[:2])
            if not tenants:
                return 0
            if len(tenants) > 1:
                raise ImproperlyConfigured(f"an update of sealed {', '.join(sorted(plain))} spans tenants; "
                                           "update each tenant's rows apart")
            kwargs.update({name: Sealed(tenants[0], value) for name, value in plain.items()})
        return super().update(**kwargs)


def tenant_of(instance: models.Model, path: str) -> int:
    if "__" not in path:
        return getattr(instance, path)
    relation = path.split("__", 1)[0]
    cached = instance._state.fields_cache.get(relation)
    if cached is not None:
        return cached.tenant_id
    field = instance._meta.get_field(relation)
    return _tenant_of_row(field.related_model._meta.label, getattr(instance, field.attname))


# (model label, pk) -> tenant id. A task's or thread's tenant never changes, but a row made in a transaction
# that rolls back is not that row: it is remembered only once what read it has committed (SQLite may give its
# primary key to the next row, of another tenant).
_row_tenants: dict[tuple[str, int], int] = {}
ROW_TENANTS_KEPT = 65536


def _tenant_of_row(model_label: str, pk: int) -> int:
    found = _row_tenants.get((model_label, pk))
    if found is None:
        found = apps.get_model(model_label).objects.values_list("tenant_id", flat=True).get(pk=pk)
        _remember(model_label, pk, found)
    return found


def remember_tenant(model: type[models.Model], pk: int, tenant_id: int) -> None:
    """A row's tenant, as a read of the row just said (a worker's claim of a task, which then opens the
    task's checkpoint): its children's content is then opened without asking the database again."""
    _remember(model._meta.label, pk, tenant_id)


def _remember(model_label: str, pk: int, tenant_id: int) -> None:
    def remember() -> None:
        if len(_row_tenants) >= ROW_TENANTS_KEPT:
            _row_tenants.clear()
        _row_tenants[(model_label, pk)] = tenant_id

    transaction.on_commit(remember)  # at once outside a transaction
