"""The HTTP helpers every app here shares (admin, serving, worker): one JSON response and one
JSON request body, so the encoding and the bad-body error are the same on every route; and
the one disconnect watcher the OpenAI routes and the worker race their waits against.

Starlette notices a disconnect only when a write fails (ASGI 2.4 servers), which for a
queued request or a slow model can be long after the client left: every wait on the engine
races the connection's `http.disconnect` instead, so a client that goes away aborts its
request at once. A client that stays connected but stops reading makes the server's writes
wait (flow control): a write that waits longer than `STREAM_WRITE_TIMEOUT` ends the response
as if the client had left.
"""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

import orjson
from starlette.requests import Request
from starlette.responses import Response

from loraplex.engine.errors import InvalidRequestError

T = TypeVar("T")
STREAM_WRITE_TIMEOUT = 30.0  # seconds one write to a client that stopped reading may wait
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


class ClientDisconnected(Exception):
    """The client closed the connection (or stopped reading) before the response was complete."""


async def wait_disconnect(receive: Callable[[], Awaitable[Mapping[str, Any]]]) -> None:
    """Returns when the client disconnects (the request body was read already)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def cancel_and_wait(task: asyncio.Future) -> None:
    """Cancel `task` and let it finish; its outcome no longer matters."""
    if not task.done():
        task.cancel()
    try:
        await task
    except BaseException:  # noqa: BLE001 - its outcome no longer matters
        pass


async def send_within(send: Callable[[Any], Awaitable[None]], message: Any, timeout: float) -> None:
    """`send(message)`, or ClientDisconnected if it waits longer than `timeout` (the client
    stopped reading). `asyncio.timeout`, not `asyncio.wait_for`: before Python 3.12 the
    latter swallows a cancellation that arrives as the send completes, and a stream whose
    client left would then run on to its end instead of aborting."""
    try:
        async with asyncio.timeout(timeout):
            await send(message)
    except TimeoutError:
        raise ClientDisconnected("the client stopped reading the stream") from None


async def unless_disconnected(work: Awaitable[T], watcher: asyncio.Future) -> T:
    """`work`'s result, or ClientDisconnected (work cancelled) if `watcher` (a
    `wait_disconnect`) ends first; cancelling the caller cancels `work` too."""
    task = asyncio.ensure_future(work)
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        await cancel_and_wait(task)
        raise
    if task.done():
        return task.result()
    await cancel_and_wait(task)
    raise ClientDisconnected()


async def until_disconnected(receive: Callable[[], Awaitable[Mapping[str, Any]]], aw: Awaitable[T]) -> T:
    """Await `aw`, cancelling it (and raising ClientDisconnected) if the client leaves first."""
    watcher = asyncio.ensure_future(wait_disconnect(receive))
    try:
        return await unless_disconnected(aw, watcher)
    finally:
        if not watcher.done():
            watcher.cancel()


__all__ = ["NO_STORE", "STREAM_WRITE_TIMEOUT", "ClientDisconnected", "cancel_and_wait", "json_body",
           "json_response", "no_store_json", "send_within", "unless_disconnected", "until_disconnected",
           "wait_disconnect"]
