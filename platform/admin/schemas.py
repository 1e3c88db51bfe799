"""The admin API's description: a small route table that yields both the Starlette routes
and the OpenAPI 3.1 document, and a JSON Schema subset validator, so what the document
says is what the server checks.

Request bodies and query parameters are checked against the same schemas the document
publishes; a failure is a 400 whose message names the field and the rule.
"""
from __future__ import annotations

import datetime as dt
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from loraplex.platform.errors import BadRequestError

# -- JSON Schema subset ----------------------------------------------------------------

_TYPES: dict[str, Callable[[Any], bool]] = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
    "null": lambda v: v is None,
}


def parse_datetime(value: str, param: str) -> dt.datetime:
    """An RFC 3339 date-time (a date alone means its midnight UTC); naive ones are UTC."""
    try:
        when = dt.datetime.fromisoformat(value.strip().replace("z", "Z"))
    except ValueError:
        raise BadRequestError(f"{param}: {value!r} is not a date-time like 2026-11-29T12:00:00Z", param) from None
    return when if when.tzinfo else when.replace(tzinfo=dt.timezone.utc)


def check_text(value: str, where: str) -> None:
    """Text the database can store: PostgreSQL refuses NUL characters."""
    if "\x00" in value:
        raise BadRequestError(f"{where}: must not contain NUL characters", where)


def validate(schema: dict, value: Any, where: str) -> None:
    """Raise BadRequestError naming `where` (a field path) when `value` breaks `schema`."""
    t = schema.get("type")
    types = t if isinstance(t, list) else [t] if t else []
    if types and not any(_TYPES[x](value) for x in types):
        want = " or ".join("null" if x == "null" else f"a{'n' if x[0] in 'aeiou' else ''} {x}" for x in types)
        raise BadRequestError(f"{where}: must be {want}", where)
    if value is None:
        return
    if "enum" in schema and value not in schema["enum"]:
        choices = ", ".join(str(x) for x in schema["enum"] if x is not None)
        raise BadRequestError(f"{where}: {value!r} is not one of {choices}", where)
    if isinstance(value, str):
        check_text(value, where)
        if len(value) < schema.get("minLength", 0):
            raise BadRequestError(f"{where}: must not be empty" if schema["minLength"] == 1
                                  else f"{where}: must be at least {schema['minLength']} characters", where)
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            raise BadRequestError(f"{where}: must be at most {schema['maxLength']} characters", where)
        if "pattern" in schema and not re.search(schema["pattern"], value):
            raise BadRequestError(f"{where}: {value!r} is not valid ({schema.get('description') or schema['pattern']})",
                                  where)
        if schema.get("format") == "date-time":
            parse_datetime(value, where)
    if _TYPES["number"](value):
        if "minimum" in schema and value < schema["minimum"]:
            raise BadRequestError(f"{where}: must be at least {schema['minimum']}", where)
        if "exclusiveMinimum" in schema and value <= schema["exclusiveMinimum"]:
            raise BadRequestError(f"{where}: must be more than {schema['exclusiveMinimum']}", where)
        if "maximum" in schema and value > schema["maximum"]:
            raise BadRequestError(f"{where}: must be at most {schema['maximum']}", where)
    if isinstance(value, list):
        if len(value) < schema.get("minItems", 0):
            raise BadRequestError(f"{where}: needs at least {schema['minItems']} item(s)", where)
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            raise BadRequestError(f"{where}: at most {schema['maxItems']} items", where)
        for i, item in enumerate(value):
            validate(schema.get("items", {}), item, f"{where}[{i}]")
        if schema.get("uniqueItems") and len({repr(x) for x in value}) != len(value):
            raise BadRequestError(f"{where}: items must be unique", where)
    if isinstance(value, dict):
        props = schema.get("properties", {})
        for name in schema.get("required", ()):
            if name not in value:
                raise BadRequestError(f"{_join(where, name)}: is required", _join(where, name))
        if schema.get("additionalProperties") is False:
            for name in value:
                if name not in props:
                    known = ", ".join(props) or "none"
                    raise BadRequestError(f"{_join(where, name)}: unknown field (known fields: {known})",
                                          _join(where, name))
        if schema.get("minProperties") and len(value) < schema["minProperties"]:
            raise BadRequestError(f"{where}: give at least one of {', '.join(props)}", where)
        for name, sub in props.items():
            if name in value:
                validate(sub, value[name], _join(where, name))


def _join(where: str, name: str) -> str:
    return name if where in ("", "body") else f"{where}.{name}"


# -- the route table -------------------------------------------------------------------

Handler = Callable[..., Awaitable[Any]]


@dataclass
class Op:
    """One admin API operation: its route, its handler and its OpenAPI description."""

    method: str
    path: str  # relative to /admin/api, Starlette/OpenAPI style: /tenants/{name}
    handler: Handler
    summary: str
    tag: str
    ok: int = 200
    out: str | dict | None = None  # a component name, or an inline schema
    body: dict | None = None  # JSON request body schema
    multipart: dict | None = None  # multipart/form-data schema (parsed by the handler)
    query: list[dict] = field(default_factory=list)  # OpenAPI parameter objects (in: query)
    auth: bool = True
    errors: tuple[int, ...] = ()
    produces: dict[str, dict] | None = None  # non-JSON responses: media type -> schema
    description: str = ""

    @property
    def operation_id(self) -> str:
        return self.handler.__name__.strip("_")


def qparam(name: str, schema: dict, description: str = "", required: bool = False) -> dict:
    return {"name": name, "in": "query", "required": required, "schema": schema, "description": description}


def check_query(op: Op, query: Any) -> dict[str, Any]:
    """The query parameters `op` declares, converted to their schema's types and checked."""
    out: dict[str, Any] = {}
    known = {p["name"] for p in op.query}
    for name in query.keys():
        if name not in known:
            raise BadRequestError(f"{name}: unknown query parameter (known: {', '.join(sorted(known)) or 'none'})",
                                  name)
    for p in op.query:
        name, schema = p["name"], p["schema"]
        raw = query.get(name)
        if raw is None:
            if p.get("required"):
                raise BadRequestError(f"{name}: is required", name)
            continue
        value: Any = raw
        kind = schema.get("type")
        if kind == "integer":
            if not re.fullmatch(r"-?[0-9]{1,18}", raw.strip()):
                raise BadRequestError(f"{name}: {raw!r} is not an integer", name)
            value = int(raw)
        elif kind == "boolean":
            if raw.lower() not in ("true", "false", "1", "0"):
                raise BadRequestError(f"{name}: {raw!r} is not true or false", name)
            value = raw.lower() in ("true", "1")
        validate(schema, value, name)
        out[name] = value
    return out


_STATUS_TEXT = {200: "OK", 201: "Created", 400: "Bad input: the message names the problem",
                401: "No admin token or session, or a wrong one", 403: "CSRF token missing or wrong",
                404: "Not found", 409: "Conflict: it exists already", 413: "Upload over the size limit",
                415: "Unsupported content type",
                429: "Too many failed authentication attempts from this address: retry after Retry-After seconds",
                501: "Not available in this build"}


def _operation(op: Op, path_params: dict[str, dict] | None) -> dict[str, Any]:
    item: dict[str, Any] = {"operationId": op.operation_id, "summary": op.summary, "tags": [op.tag]}
    if op.description:
        item["description"] = op.description
    params = [{"name": n, "in": "path", "required": True,
               "schema": (path_params or {}).get(n, {"type": "string", "minLength": 1})}
              for n in re.findall(r"{(\w+)}", op.path)]
    if op.method not in ("GET", "HEAD") and op.auth:
        params.append({"name": "X-CSRF-Token", "in": "header", "required": False, "schema": {"type": "string"},
                       "description": "The session's CSRF token: required with a session cookie, "
                                      "not with a Bearer token."})
    params += op.query
    if params:
        item["parameters"] = params
    if op.body is not None:
        item["requestBody"] = {"required": True, "content": {"application/json": {"schema": op.body}}}
    if op.multipart is not None:
        item["requestBody"] = {"required": True, "content": {"multipart/form-data": {"schema": op.multipart}}}
    if not op.auth:
        item["security"] = []
    item["responses"] = _responses(op)
    return item


def _responses(op: Op) -> dict[str, Any]:
    """The success answer, then every error status the operation can give."""
    responses: dict[str, Any] = {}
    if op.produces:
        responses[str(op.ok)] = {"description": _STATUS_TEXT[op.ok],
                                 "content": {mt: {"schema": s} for mt, s in op.produces.items()}}
    elif op.ok == 204:
        responses["204"] = {"description": "Done"}
    else:
        schema = {"$ref": f"#/components/schemas/{op.out}"} if isinstance(op.out, str) else (op.out or {})
        responses[str(op.ok)] = {"description": _STATUS_TEXT[op.ok],
                                 "content": {"application/json": {"schema": schema}}}
    codes = set(op.errors)
    if op.auth:
        codes |= {401}
        if op.method not in ("GET", "HEAD"):
            codes |= {403}
    if op.body is not None or op.query or op.multipart is not None or "{" in op.path:
        codes |= {400}
    if op.body is not None:
        codes |= {415}
    if op.body is not None or op.multipart is not None:
        codes |= {413}  # every body has a size limit
    if op.auth or op.body is not None:
        codes |= {429}
    if "{" in op.path:
        codes |= {404}
    for code in sorted(codes):
        responses[str(code)] = {"$ref": "#/components/responses/Error"}
    return responses


def openapi_document(ops: list[Op], components: dict[str, dict], *, title: str, version: str,
                     description: str, prefix: str = "/admin/api",
                     path_params: dict[str, dict] | None = None) -> dict:
    paths: dict[str, dict] = {}
    for op in ops:
        paths.setdefault(prefix + op.path, {})[op.method.lower()] = _operation(op, path_params)
    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version, "description": description},
        "servers": [{"url": "/"}],
        "security": [{"bearerAuth": []}, {"sessionCookie": []}],
        "tags": [{"name": t} for t in dict.fromkeys(op.tag for op in ops)],
        "paths": paths,
        "components": {
            "securitySchemes": {
                "bearerAuth": {"type": "http", "scheme": "bearer",
                               "description": "The admin token ($LORAPLEX_ADMIN_TOKEN, or the one printed at first "
                                              "start)."},
                "sessionCookie": {"type": "apiKey", "in": "cookie", "name": "lpx_admin_session",
                                  "description": "A browser session from POST /admin/api/session; changes also need "
                                                 "the X-CSRF-Token header."},
            },
            "responses": {"Error": {"description": "An error; `error.message` names the problem",
                                    "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}},
            "schemas": {**components, "Error": ERROR_SCHEMA},
        },
    }


ERROR_SCHEMA = {
    "type": "object", "required": ["error"],
    "properties": {"error": {"type": "object", "required": ["message", "type"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]},
        "request_id": {"type": "string", "description": "the request's id, as in the x-request-id header"}}}},
}
