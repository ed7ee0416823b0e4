"""Hypothesis strategies for the JSON Schema subset that pydantic writes for the server's request bodies: type,
anyOf, const, enum, properties/required, items, additionalProperties, min/max (exclusive too) and min/max length.
(hypothesis-jsonschema does this in general but no longer runs on current hypothesis.)"""

from __future__ import annotations

from hypothesis import strategies as st

SHORT = 12  # strings and lists stay short: a fuzz body should be cheap to answer


def from_schema(schema: dict) -> st.SearchStrategy:
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    if "anyOf" in schema:
        return st.one_of([from_schema(_merged(schema, branch)) for branch in schema["anyOf"]])
    kind = schema.get("type")
    if kind is None:
        return st.none() | st.booleans() | st.integers() | st.text(max_size=SHORT)
    return _BY_TYPE[kind](schema)


def _merged(schema: dict, branch: dict) -> dict:
    """One branch of an anyOf, with the keywords the schema states beside the anyOf (e.g. a description)."""
    outer = {k: v for k, v in schema.items() if k not in ("anyOf", "default", "title", "description")}
    return {**outer, **branch}


def _integer(schema: dict) -> st.SearchStrategy:
    low, high = schema.get("minimum"), schema.get("maximum")
    if "exclusiveMinimum" in schema:
        low = schema["exclusiveMinimum"] + 1
    if "exclusiveMaximum" in schema:
        high = schema["exclusiveMaximum"] - 1
    return st.integers(min_value=low, max_value=high)


def _number(schema: dict) -> st.SearchStrategy:
    return st.floats(min_value=schema.get("minimum", schema.get("exclusiveMinimum")),
                     max_value=schema.get("maximum", schema.get("exclusiveMaximum")),
                     exclude_min="exclusiveMinimum" in schema, exclude_max="exclusiveMaximum" in schema,
                     allow_nan=False, allow_infinity=False)


def _string(schema: dict) -> st.SearchStrategy:
    return st.text(min_size=schema.get("minLength", 0), max_size=min(schema.get("maxLength", SHORT), SHORT))


def _array(schema: dict) -> st.SearchStrategy:
    items = from_schema(schema.get("items", {}))
    low = schema.get("minItems", 0)
    return st.lists(items, min_size=low, max_size=max(low, min(schema.get("maxItems", 4), 4)))


def _object(schema: dict) -> st.SearchStrategy:
    properties = schema.get("properties", {})
    if not properties:
        values = schema.get("additionalProperties")
        return st.dictionaries(st.text(max_size=SHORT), from_schema(values if isinstance(values, dict) else {}),
                               max_size=3)
    required = set(schema.get("required", ()))
    return st.fixed_dictionaries({k: from_schema(v) for k, v in properties.items() if k in required},
                                 optional={k: from_schema(v) for k, v in properties.items() if k not in required})


_BY_TYPE = {"integer": _integer, "number": _number, "string": _string, "boolean": lambda _: st.booleans(),
            "null": lambda _: st.none(), "array": _array, "object": _object}
