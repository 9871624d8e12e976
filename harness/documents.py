"""Typed documents: the JSON files the harness writes and reads, each declared once as a class.

A document class is a pydantic dataclass configured with :data:`DOCUMENT`: closed (a key it
does not declare is refused), NaN and infinities refused, and in its JSON Schema every field
required, defaults included (a file states every field; code constructing one may leave
defaults out). The JSON Schema a file is checked against is generated from the class
(:func:`schema_of`), so the format and the type a reader returns cannot drift apart.

:func:`read_document` checks a parsed JSON value against that schema first, so an error names
the field and what would be valid (:func:`harness.fileio.validate`), then returns the typed
object. :func:`document_json` is the inverse: the plain JSON value of a document.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Annotated, Any, TypeVar

from pydantic import ConfigDict, Field, GetCoreSchemaHandler, TypeAdapter, ValidationError
from pydantic_core import CoreSchema, core_schema

from harness.errors import HarnessError
from harness.fileio import validate

DOCUMENT = ConfigDict(extra="forbid", allow_inf_nan=False, json_schema_serialization_defaults_required=True)
SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"
# A content digest as harness.fileio.digest writes it.
Digest = Annotated[str, Field(pattern="^sha256:[0-9a-f]{64}$")]

T = TypeVar("T")


class OneOf:
    """Field metadata (``Annotated[str, OneOf(values)]``): the string is one of ``values``.

    For sets of names the code holds elsewhere (modes, dtypes): validated as a ``Literal`` of
    them would be, its schema an ``enum`` (a ``const`` for one value).
    """

    def __init__(self, values: Iterable[str]) -> None:
        self.values = list(values)

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> CoreSchema:
        return core_schema.literal_schema(self.values)


_ADAPTERS: dict[type[Any], TypeAdapter[Any]] = {}


def _adapter(cls: type[Any]) -> TypeAdapter[Any]:
    adapter = _ADAPTERS.get(cls)
    if adapter is None:
        adapter = _ADAPTERS[cls] = TypeAdapter(cls)
    return adapter


def schema_of(cls: type[Any], title: str) -> dict[str, Any]:
    """The JSON Schema of document class ``cls``, as a file of it is written (every field present)."""
    schema = _adapter(cls).json_schema(mode="serialization")
    return {"$schema": SCHEMA_DIALECT, **schema, "title": title}


def read_document(cls: type[T], obj: Any, schema: dict[str, Any], where: str) -> T:
    """``obj`` (parsed JSON) as a ``cls``, checked against ``schema`` (:func:`schema_of` of ``cls``).

    Raises HarnessError naming ``where`` and the first offending field.
    """
    validate(obj, schema, where)
    return read_typed(cls, obj, where)


def read_typed(cls: type[T], obj: Any, where: str) -> T:
    """``obj`` (parsed JSON, already checked against the schema of ``cls``) as a ``cls``.

    Raises HarnessError naming ``where`` and the first offending field.
    """
    try:
        value: T = _adapter(cls).validate_python(obj)
    except ValidationError as exc:
        error = exc.errors()[0]
        field = "/".join(str(part) for part in error["loc"]) or "(top level)"
        raise HarnessError(f"{where}: invalid at {field}: {error['msg']}") from None
    return value


def document_json(obj: Any) -> Any:
    """The JSON value of a document (or of a part of one): objects, arrays, strings, numbers."""
    return _adapter(type(obj)).dump_python(obj, mode="json")
