from __future__ import annotations

import asyncio

import pytest
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from loraplex.platform.observability.request_id import (
    MAX_REQUEST_ID_LENGTH, RequestIdMiddleware, accept_request_id, bind_request_id, current_request_id)


@pytest.mark.parametrize("value", ["abc-123", "A" * MAX_REQUEST_ID_LENGTH, "trace:01/x_y.z", b"from-bytes"])
def test_a_sane_id_is_kept(value):
    assert accept_request_id(value) == (value.decode() if isinstance(value, bytes) else value)


@pytest.mark.parametrize("value", [None, "", "A" * (MAX_REQUEST_ID_LENGTH + 1), "has space", "tab\there",
                                   "new\nline", "ünïcode", b"\xff\xfe", "\x00"])
def test_an_insane_id_is_replaced(value):
    made = accept_request_id(value)
    assert made != value and made.startswith("req-") and len(made) == 36
    assert accept_request_id(value) != made  # a new one each time


def test_the_id_is_per_task():
    async def handle(rid: str) -> str | None:
        with bind_request_id(rid):
            await asyncio.sleep(0)
            return current_request_id()

    async def main() -> list[str | None]:
        return await asyncio.gather(*(handle(f"r{i}") for i in range(5)))

    assert asyncio.run(main()) == [f"r{i}" for i in range(5)]
    assert current_request_id() is None


def test_middleware_binds_and_returns_the_id():
    seen = []

    async def endpoint(request):
        seen.append((current_request_id(), request.state.request_id))
        return JSONResponse({"ok": True}, headers={"x-request-id": "handler-must-not-win"})

    app = Starlette(routes=[Route("/", endpoint)])
    app.add_middleware(RequestIdMiddleware)
    with TestClient(app) as client:
        kept = client.get("/", headers={"x-request-id": "client-id-1"})
        made = client.get("/", headers={"x-request-id": "bad id"})
        none = client.get("/")
    assert kept.headers["x-request-id"] == "client-id-1"
    assert made.headers["x-request-id"].startswith("req-") and none.headers["x-request-id"].startswith("req-")
    assert kept.headers.get_list("x-request-id") == ["client-id-1"]
    assert seen == [(r.headers["x-request-id"],) * 2 for r in (kept, made, none)]
