"""The HTTP helpers every app here shares (admin, serving, worker): one JSON response and one
JSON request body, so the encoding and the bad-body error are the same on every route."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from loraplex.engine.errors import InvalidRequestError

NO_STORE = {"Cache-Control": "no-store"}  # what a response naming secrets or live state carries


def json_response(obj: Any, status: int = 200, headers: Mapping[str, str] | None = None) -> Response:
    """`obj` as JSON (UTC datetimes end in `Z`)."""
    return Response(orjson.dumps(obj, option=orjson.OPT_UTC_Z), status_code=status, media_type="application/json",
                    headers=dict(headers) if headers else None)


def no_store_json(obj: Any, status: int = 200, headers: Mapping[str, str] | None = None) -> Response:
    """`json_response` that no cache keeps (the admin API: secrets and live state)."""
    return json_response(obj, status, {**NO_STORE, **(headers or {})})


async def json_body(request: Request) -> Any:
    """The request's JSON body; InvalidRequestError (400) when it is not JSON."""
    try:
        return orjson.loads(await request.body())
    except orjson.JSONDecodeError:
        raise InvalidRequestError("the request body is not valid JSON") from None


__all__ = ["NO_STORE", "json_body", "json_response", "no_store_json"]
