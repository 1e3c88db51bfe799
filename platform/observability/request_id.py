"""One id per request: accepted from `x-request-id` when sane, else made here.

The id lives in a context variable so every log line, span and usage event written while
the request is handled can carry it without passing it around.
"""
from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

REQUEST_ID_HEADER = "x-request-id"
MAX_REQUEST_ID_LENGTH = 128
# Visible ASCII only: no spaces, control characters or anything a log or header could
# be split on.
_SANE = re.compile(rf"[\x21-\x7e]{{1,{MAX_REQUEST_ID_LENGTH}}}")

request_id_var: ContextVar[str | None] = ContextVar("loraplex_request_id", default=None)


def new_request_id() -> str:
    return f"req-{uuid.uuid4().hex}"


def is_sane_request_id(value: str) -> bool:
    return _SANE.fullmatch(value) is not None


def accept_request_id(value: str | bytes | None) -> str:
    """The client's id when it is sane, a new one otherwise (never an error: ids are advisory)."""
    if isinstance(value, bytes):
        try:
            value = value.decode("ascii")
        except UnicodeDecodeError:
            value = None
    return value if value is not None and is_sane_request_id(value) else new_request_id()


def current_request_id() -> str | None:
    return request_id_var.get()


@contextmanager
def bind_request_id(request_id: str) -> Iterator[str]:
    token = request_id_var.set(request_id)
    try:
        yield request_id
    finally:
        request_id_var.reset(token)


class RequestIdMiddleware:
    """ASGI middleware: binds each HTTP request's id and returns it in `x-request-id`.

    Handlers read it with `current_request_id()` (or `scope["state"]["request_id"]`,
    Starlette's `request.state.request_id`).
    """

    def __init__(self, app) -> None:
        self.app = app
        self._header = REQUEST_ID_HEADER.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        sent = dict(scope["headers"]).get(self._header)
        rid = accept_request_id(sent)
        scope.setdefault("state", {})["request_id"] = rid

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != self._header]
                message = {**message, "headers": [*headers, (self._header, rid.encode())]}
            await send(message)

        with bind_request_id(rid):
            await self.app(scope, receive, send_with_id)
