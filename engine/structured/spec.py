"""What a request's output must look like: plain, hashable data checked up front.

A `StructuredOutput` is built by the API layer from `response_format` or from `tools` +
`tool_choice`; its `key` identifies the compiled grammar in the cache. Schema features
the grammar engine would silently ignore are refused here with `UnsupportedSchemaError`,
and schemas over the caps below (what bounds one grammar's compile time) with
`SchemaTooLargeError`, whose message names the cap.
"""
from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import orjson

from ..errors import InvalidRequestError

Kind = Literal["json_object", "json_schema", "tool_call"]

# Keywords whose sub-values are schemas (maps of them, lists of them, or one).
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_VALUES = ("items", "additionalProperties", "propertyNames", "not", "if", "then", "else",
                  "contains", "unevaluatedProperties", "unevaluatedItems", "additionalItems")
# Keywords xgrammar accepts but does not enforce: honouring them is impossible, so a
# request using them is refused rather than answered with output that may break them.
_UNENFORCED = frozenset({"not", "if", "then", "else", "dependentRequired", "dependentSchemas",
                         "contains", "minContains", "maxContains"})

# Caps on one request's schema (for tools: all of its functions' schemas together).
MAX_SCHEMA_BYTES = 65_536  # the canonical JSON
MAX_SCHEMA_PROPERTIES = 1_000  # object properties, summed over the schema
MAX_SCHEMA_DEPTH = 10  # nested sub-schemas
MAX_SCHEMA_ENUM_VALUES = 1_000  # enum values and consts, summed
MAX_SCHEMA_PATTERN_CHARS = 1_000  # one `pattern`
MAX_PATTERN_REPEAT = 256  # a {n} / {n,m} count inside a pattern (expanded by the grammar)
MAX_TOOLS = 128
_REPEAT = re.compile(r"\{(\d+)(?:,(\d*))?\}")


class UnsupportedSchemaError(InvalidRequestError):
    """The schema uses features constrained decoding cannot enforce (the API answers 400)."""

    def __init__(self, features: list[str]) -> None:
        self.features = features
        super().__init__("unsupported JSON schema features: " + ", ".join(features))


class SchemaTooLargeError(InvalidRequestError):
    """The schema is over one of the caps above (the API answers 400 naming it)."""

    def __init__(self, what: str, cap: int, name: str, value: int | None = None) -> None:
        self.cap_name, self.cap = name, cap
        got = "" if value is None else f" ({value})"
        super().__init__(f"the schema's {what}{got} is over the cap of {cap} ({name})")


class _Budget:
    """What a walk over one request's schemas counted so far, checked against the caps."""

    def __init__(self) -> None:
        self.properties = 0
        self.enum_values = 0

    def add_properties(self, n: int) -> None:
        self.properties += n
        if self.properties > MAX_SCHEMA_PROPERTIES:
            raise SchemaTooLargeError("number of object properties", MAX_SCHEMA_PROPERTIES, "max_schema_properties")

    def add_enum_values(self, n: int) -> None:
        self.enum_values += n
        if self.enum_values > MAX_SCHEMA_ENUM_VALUES:
            raise SchemaTooLargeError("number of enum and const values", MAX_SCHEMA_ENUM_VALUES,
                                      "max_schema_enum_values")


def _check_pattern(pattern: Any, path: str) -> None:
    if not isinstance(pattern, str):
        return
    if len(pattern) > MAX_SCHEMA_PATTERN_CHARS:
        raise SchemaTooLargeError(f"pattern at {path} length", MAX_SCHEMA_PATTERN_CHARS,
                                  "max_schema_pattern_chars", len(pattern))
    for m in _REPEAT.finditer(pattern):
        count = max(int(m.group(1)), int(m.group(2) or 0))
        if count > MAX_PATTERN_REPEAT:
            raise SchemaTooLargeError(f"pattern at {path} repeat count", MAX_PATTERN_REPEAT,
                                      "max_schema_pattern_repeat", count)


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on the whole output. `spec` is canonical JSON (the schema, or the
    resolved tool list); property order is kept because the grammar follows it."""

    kind: Kind
    spec: str = ""
    strict: bool = False

    @property
    def key(self) -> tuple[str, str, bool]:
        return self.kind, self.spec, self.strict

    @classmethod
    def json_object(cls) -> "StructuredOutput":
        return cls("json_object")

    @classmethod
    def json_schema(cls, schema: Any, strict: bool = False) -> "StructuredOutput":
        _check_size(schema)  # first, and fast: it bounds the canonical form and the walk below
        spec = _capped(_canonical(schema))
        check_schema(schema)
        return cls("json_schema", spec, bool(strict))

    @classmethod
    def tool_call(cls, tools: Any, tool_choice: Any = "required", parallel_tool_calls: bool = True
                  ) -> "StructuredOutput":
        """The grammar of a Hermes-style call: `required` (one or more calls to any
        declared function, one if not parallel) or a named function (exactly one call)."""
        functions = _functions(tools)
        if tool_choice == "required":
            chosen, parallel = functions, bool(parallel_tool_calls)
        elif isinstance(tool_choice, Mapping) and isinstance(tool_choice.get("function"), Mapping):
            name = tool_choice["function"].get("name")
            chosen = [f for f in functions if f["name"] == name]
            if not chosen:
                raise InvalidRequestError(f"tool_choice names function {name!r}, which is not in tools")
            parallel = False
        else:
            raise InvalidRequestError(
                f"tool_choice {tool_choice!r} does not constrain the output; use 'required' or a named function")
        return cls("tool_call", _capped(_canonical({"functions": chosen, "parallel": parallel})), True)


def _canonical(value: Any) -> str:
    try:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise InvalidRequestError(f"the schema is not plain JSON: {exc}") from None


def _check_size(value: Any) -> None:
    """SchemaTooLargeError from orjson's size of `value` (the canonical form's to within
    float spelling), which it measures many times faster than json.dumps: an oversized
    schema costs its sender, not the interpreter lock every tenant shares."""
    try:
        size = len(orjson.dumps(value))
    except (TypeError, orjson.JSONEncodeError):
        return  # _canonical names the problem
    if size > MAX_SCHEMA_BYTES:
        raise SchemaTooLargeError("size in bytes", MAX_SCHEMA_BYTES, "max_schema_bytes", size)


def _capped(spec: str) -> str:
    size = len(spec.encode())
    if size > MAX_SCHEMA_BYTES:
        raise SchemaTooLargeError("size in bytes", MAX_SCHEMA_BYTES, "max_schema_bytes", size)
    return spec


def _functions(tools: Any) -> list[dict]:
    if not isinstance(tools, list) or not tools:
        raise InvalidRequestError("tools must be a non-empty list")
    if len(tools) > MAX_TOOLS:
        raise SchemaTooLargeError("number of tools", MAX_TOOLS, "max_tools", len(tools))
    out, budget = [], _Budget()
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(tool, Mapping) or tool.get("type", "function") != "function" or not isinstance(fn, Mapping):
            raise InvalidRequestError(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidRequestError(f"tools[{i}].function.name must be a non-empty string")
        params = fn.get("parameters")
        params = {"type": "object", "properties": {}} if params is None else params
        check_schema(params, f"tools[{i}].function.parameters", budget)
        out.append({"name": name, "parameters": params})
    names = [f["name"] for f in out]
    if len(set(names)) != len(names):
        raise InvalidRequestError("tools declare the same function name twice")
    return out


def check_schema(schema: Any, where: str = "schema", budget: _Budget | None = None) -> None:
    """Raise `UnsupportedSchemaError` naming every feature that cannot be enforced, or
    `SchemaTooLargeError` for the first cap it is over (`budget` sums several schemas)."""
    if not isinstance(schema, Mapping):
        raise InvalidRequestError(f"{where} must be a JSON object")
    problems: list[str] = []
    _walk(schema, "#", problems, budget or _Budget(), 1)
    if problems:
        raise UnsupportedSchemaError(problems)


def _walk(node: Any, path: str, problems: list[str], budget: _Budget, depth: int) -> None:
    if not isinstance(node, Mapping):
        return  # booleans are valid schemas; anything else the grammar builder reports
    if depth > MAX_SCHEMA_DEPTH:
        raise SchemaTooLargeError(f"nesting depth at {path}", MAX_SCHEMA_DEPTH, "max_schema_depth")
    if isinstance(node.get("properties"), Mapping):
        budget.add_properties(len(node["properties"]))
    if isinstance(node.get("enum"), list):
        budget.add_enum_values(len(node["enum"]))
    if "const" in node:
        budget.add_enum_values(1)
    _check_pattern(node.get("pattern"), path)
    for kw in _UNENFORCED & node.keys():
        problems.append(f"'{kw}' at {path}")
    if node.get("uniqueItems") is True:
        problems.append(f"'uniqueItems' at {path}")
    if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
        problems.append(f"'allOf' with several schemas at {path}")
    ref = node.get("$ref")
    if isinstance(ref, str) and not (ref == "#" or ref.startswith("#/")):
        problems.append(f"'$ref' to another document ({ref}) at {path}")
    for kw in _SCHEMA_MAPS:
        if isinstance(node.get(kw), Mapping):
            for name, sub in node[kw].items():
                _walk(sub, f"{path}/{kw}/{name}", problems, budget, depth + 1)
    for kw in _SCHEMA_LISTS:
        if isinstance(node.get(kw), list):
            for i, sub in enumerate(node[kw]):
                _walk(sub, f"{path}/{kw}/{i}", problems, budget, depth + 1)
    for kw in _SCHEMA_VALUES:
        sub = node.get(kw)
        for i, s in enumerate(sub) if isinstance(sub, list) else [(None, sub)]:
            _walk(s, f"{path}/{kw}" + ("" if i is None else f"/{i}"), problems, budget, depth + 1)
