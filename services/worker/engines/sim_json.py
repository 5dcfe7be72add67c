"""Schema-valid JSON for the sim engine's structured outputs (simulated, like all its text).

`instance(schema, rng)` builds one value that validates against a JSON Schema, drawn from
`rng` (so a seed gives the same value). Supported: `type` (object, array, string, integer,
number, boolean, null, or a list of them: the first non-null), `enum`, `const`,
`anyOf`/`oneOf` (one branch, drawn), `allOf` with a single schema, local `$ref`s
(`#/$defs/...`, `#/definitions/...`), object `properties` (every required one, each
optional one with probability 1/2; no extra properties), `minProperties` is not honoured
beyond the listed properties, arrays (`items`, `prefixItems`, `minItems`/`maxItems`,
`uniqueItems` only for enums/booleans by luck), strings (`minLength`/`maxLength`; `pattern`
and `format` are NOT honoured: a schema with them is refused, except the formats `date`,
`date-time`, `email` and `uuid`, which get a fixed valid value), integers and numbers
(`minimum`/`maximum`, exclusive bounds, `multipleOf` for integers). Anything else
(`not`, `if`/`then`, `patternProperties`, `dependentSchemas`...) raises UnsupportedSchema,
which the engine answers with a 400. `json_object` gives `{"simulated": true}`.
"""
from __future__ import annotations

import json
import random
from typing import Any

WORDS = ("alpha", "bravo", "delta", "echo", "kilo", "lima", "oscar", "sierra", "tango", "zulu")
FORMATS = {"date": "2024-01-01", "date-time": "2024-01-01T00:00:00Z", "email": "sim@example.com",
           "uuid": "00000000-0000-4000-8000-000000000000"}
_UNSUPPORTED = ("not", "if", "then", "else", "patternProperties", "dependentSchemas", "dependentRequired",
                "contains", "propertyNames", "unevaluatedProperties")


class UnsupportedSchema(ValueError):
    """The sim cannot generate an instance of this schema."""


def instance(schema: Any, rng: random.Random, root: Any = None, depth: int = 0) -> Any:
    """One value valid against `schema` (see the module docstring for what is supported)."""
    root = schema if root is None else root
    if depth > 16:
        raise UnsupportedSchema("schema nests deeper than 16 levels")
    if schema is True or schema == {}:
        return "simulated"
    if not isinstance(schema, dict):
        raise UnsupportedSchema(f"not a schema: {schema!r}")
    bad = [k for k in _UNSUPPORTED if k in schema]
    if bad:
        raise UnsupportedSchema(f"the sim engine cannot generate for '{bad[0]}'")
    if "$ref" in schema:
        return instance(_resolve(schema["$ref"], root), rng, root, depth + 1)
    if "const" in schema:
        return schema["const"]
    if "enum" in schema:
        return rng.choice(schema["enum"])
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return instance(rng.choice(schema[key]), rng, root, depth + 1)
    if "allOf" in schema:
        if len(schema["allOf"]) != 1:
            raise UnsupportedSchema("allOf with more than one schema")
        return instance(schema["allOf"][0], rng, root, depth + 1)
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind is None:
        kind = "object" if "properties" in schema else "array" if "items" in schema else "string"
    make = _MAKERS.get(kind)
    if make is None:
        raise UnsupportedSchema(f"unknown type {kind!r}")
    return make(schema, rng, root, depth)


def _resolve(ref: str, root: Any) -> Any:
    if not ref.startswith("#/"):
        raise UnsupportedSchema(f"only local $refs are supported, not {ref!r}")
    node = root
    for part in ref[2:].split("/"):
        node = node.get(part) if isinstance(node, dict) else None
    if node is None:
        raise UnsupportedSchema(f"$ref {ref!r} points nowhere")
    return node


def _object(schema: dict, rng: random.Random, root: Any, depth: int) -> dict:
    props = schema.get("properties") or {}
    required = set(schema.get("required") or [])
    missing = required - set(props)
    if missing:
        raise UnsupportedSchema(f"required property {sorted(missing)[0]!r} has no schema")
    return {name: instance(sub, rng, root, depth + 1) for name, sub in props.items()
            if name in required or rng.random() < 0.5}


def _array(schema: dict, rng: random.Random, root: Any, depth: int) -> list:
    prefix = schema.get("prefixItems") or []
    lo = max(int(schema.get("minItems", 0)), len(prefix))
    hi = int(schema.get("maxItems", max(lo, 3)))
    if hi < lo:
        raise UnsupportedSchema("maxItems below minItems")
    count = rng.randint(lo, max(lo, min(hi, lo + 3)))
    items = schema.get("items", {})
    return [instance(prefix[i] if i < len(prefix) else items, rng, root, depth + 1) for i in range(count)]


def _string(schema: dict, rng: random.Random, root: Any, depth: int) -> str:
    if "pattern" in schema:
        raise UnsupportedSchema("the sim engine cannot generate strings matching a 'pattern'")
    fmt = schema.get("format")
    if fmt is not None:
        if fmt not in FORMATS:
            raise UnsupportedSchema(f"the sim engine cannot generate strings of format {fmt!r}")
        return FORMATS[fmt]
    lo, hi = int(schema.get("minLength", 0)), schema.get("maxLength")
    text = "sim-" + rng.choice(WORDS)
    text = text.ljust(lo, "x")
    return text if hi is None else text[:int(hi)]


def _number(schema: dict, rng: random.Random, root: Any, depth: int, integer: bool = False) -> int | float:
    lo, hi = schema.get("minimum"), schema.get("maximum")
    if "exclusiveMinimum" in schema:
        lo = schema["exclusiveMinimum"] + (1 if integer else 1e-6)
    if "exclusiveMaximum" in schema:
        hi = schema["exclusiveMaximum"] - (1 if integer else 1e-6)
    lo = lo if lo is not None else (hi - 100 if hi is not None else 0)
    hi = hi if hi is not None else lo + 100
    if integer:
        import math
        lo_i, hi_i = math.ceil(lo), math.floor(hi)
        step = int(schema.get("multipleOf", 1))
        choices = [v for v in range(lo_i, min(hi_i, lo_i + 1000 * step) + 1) if v % step == 0]
        if not choices:
            raise UnsupportedSchema("no integer in the schema's range")
        return rng.choice(choices)
    if hi < lo:
        raise UnsupportedSchema("maximum below minimum")
    return round(rng.uniform(lo, hi), 3) if hi - lo > 0.01 else lo


_MAKERS = {
    "object": _object, "array": _array, "string": _string,
    "integer": lambda s, r, root, d: _number(s, r, root, d, integer=True), "number": _number,
    "boolean": lambda s, r, root, d: r.random() < 0.5, "null": lambda s, r, root, d: None,
}


def text(spec, rng: random.Random) -> str:
    """The simulated output text of a StructuredOutput (json, json_object or choice)."""
    kind = spec.kind()
    if kind == "json_object":
        return json.dumps({"simulated": True})
    if kind == "choice":
        return rng.choice(spec.choice)
    if kind != "json":
        raise UnsupportedSchema(f"the sim engine cannot generate from a {kind} (json_schema, json_object and "
                                "choice only)")
    return json.dumps(instance(json.loads(spec.json), rng))


def pieces(value: str, size: int = 4) -> list[str]:
    """`value` as the sim's output tokens: pieces of up to `size` characters."""
    return [value[i:i + size] for i in range(0, len(value), size)] or [""]
