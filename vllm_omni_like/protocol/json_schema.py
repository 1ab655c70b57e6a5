"""The JSON Schema subset guided decoding supports; any other keyword is a 400 that names it.

Supported (what llguidance enforces while it decodes, checked against it by the tests):
`type` (a name or a list), `properties`, `required`, `additionalProperties`,
`patternProperties`, `minProperties`, `maxProperties`; `items`, `prefixItems`, `minItems`,
`maxItems`; `enum`, `const`; `minLength`, `maxLength`, `pattern`, `format`; `minimum`,
`maximum`, `exclusiveMinimum`, `exclusiveMaximum`, `multipleOf`; `anyOf`, `oneOf`, `allOf`;
`$ref` with `$defs` / `definitions`; and the annotations `title`, `description`, `default`,
`examples`, `$schema`, `$id`, `$comment`, `deprecated`, `readOnly`, `writeOnly`, which
constrain nothing. Not supported (among others): `not`, `if`/`then`/`else`, `contains`,
`uniqueItems`, `dependentRequired`, `dependentSchemas`, `propertyNames`,
`unevaluatedProperties`, `unevaluatedItems`.
"""

from __future__ import annotations

from typing import Any

from vllm_omni_like.errors import InvalidRequestError

KEYWORDS = frozenset(
    {
        "type", "properties", "required", "additionalProperties", "patternProperties",
        "minProperties", "maxProperties", "items", "prefixItems", "minItems", "maxItems",
        "enum", "const", "minLength", "maxLength", "pattern", "format", "minimum", "maximum",
        "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "anyOf", "oneOf", "allOf",
        "$ref", "$defs", "definitions",
    }
)  # fmt: skip
ANNOTATIONS = frozenset(
    {
        "title", "description", "default", "examples", "$schema", "$id", "$comment",
        "deprecated", "readOnly", "writeOnly",
    }
)  # fmt: skip
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")  # name -> schema
SCHEMA_LISTS = ("prefixItems", "anyOf", "oneOf", "allOf")
SCHEMA_VALUES = ("items", "additionalProperties")  # a schema or a boolean
PARAM = "response_format.json_schema.schema"


def _bad(path: str, message: str) -> InvalidRequestError:
    return InvalidRequestError(
        f"{message} (at {path or '/'})", param=PARAM, code="unsupported_schema"
    )


def check_schema(schema: Any, path: str = "") -> None:
    """Raise a 400 for a schema outside the supported subset (or not a schema at all)."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise _bad(path, "a schema must be an object or a boolean")
    for key, value in schema.items():
        if key in ANNOTATIONS:
            continue
        if key not in KEYWORDS:
            raise _bad(path, f"the schema keyword {key!r} is not supported by guided decoding")
        where = f"{path}/{key}"
        if key in SCHEMA_MAPS:
            if not isinstance(value, dict):
                raise _bad(where, f"{key} must map names to schemas")
            for name, sub in value.items():
                check_schema(sub, f"{where}/{name}")
        elif key in SCHEMA_LISTS:
            if not isinstance(value, list) or not value:
                raise _bad(where, f"{key} must be a non-empty list of schemas")
            for i, sub in enumerate(value):
                check_schema(sub, f"{where}/{i}")
        elif key in SCHEMA_VALUES:
            check_schema(value, where)
