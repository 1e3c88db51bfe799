"""The listener's pure parts: which peers count as trusted proxies (exempt from the
per-address connection cap), and the limits' validation. The protocol itself is
exercised over real sockets in tests/e2e/isolation/ and tests/e2e/resources/."""
from __future__ import annotations

import asyncio
import json

import pytest

from loraplex.platform.serving import listener
from loraplex.platform.serving.listener import TrustedPeers, over_cap_response
from loraplex.platform.settings import ServerLimits


def test_trusted_peers_match_uvicorn_forms():
    peers = TrustedPeers("127.0.0.1, 10.0.0.0/8,fd00::/8,unix-proxy")
    assert "127.0.0.1" in peers and "10.9.8.7" in peers and "fd00::1" in peers and "unix-proxy" in peers
    assert "127.0.0.2" not in peers and "192.168.1.1" not in peers and "not an address" not in peers
    assert "8.8.8.8" in TrustedPeers("*") and "8.8.8.8" not in TrustedPeers("")


def test_the_over_cap_answer_is_an_openai_429_that_closes():
    head, _, body = over_cap_response(7).partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    assert lines[0] == "HTTP/1.1 429 Too Many Requests"
    headers = dict(x.split(": ", 1) for x in lines[1:])
    assert headers["connection"] == "close" and int(headers["content-length"]) == len(body)
    err = json.loads(body)["error"]
    assert err["type"] == "rate_limit_error" and "7 connections" in err["message"]


@pytest.mark.parametrize("field", ["body_min_rate", "max_connections_per_client"])
def test_new_limits_must_be_positive(field):
    with pytest.raises(ValueError, match=field):
        ServerLimits(**{field: 0})


def test_a_streaming_response_has_the_small_send_buffers_and_the_connection_gets_its_own_back():
    """While an SSE response streams, its connection's kernel send buffer (and transport
    high-water mark) are `stream_send_buffer_bytes`, so a client that stops reading backs
    the stream up into the app after a few KiB; the next response on the same keep-alive
    connection has `send_buffer_bytes` again."""
    import asyncio
    import socket
    import threading
    import time

    import httpx
    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse, StreamingResponse
    from starlette.routing import Route

    from loraplex.platform.serving.listener import uvicorn_config
    from loraplex.platform.settings import Settings

    release = threading.Event()

    async def stream(request):
        async def events():
            yield b"data: 1\n\n"
            while not release.is_set():
                await asyncio.sleep(0.01)
            yield b"data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")

    async def plain(request):
        return PlainTextResponse("ok")

    app = Starlette(routes=[Route("/s", stream), Route("/p", plain)])
    settings = Settings(limits=ServerLimits(send_buffer_bytes=128 * 1024, stream_send_buffer_bytes=8 * 1024))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn_config(app, settings, log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()

    def server_side() -> tuple[int, int]:
        (conn,) = list(server.server_state.connections)
        kernel = conn.transport.get_extra_info("socket").getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
        return kernel, conn.transport.get_write_buffer_limits()[1]

    try:
        deadline = time.monotonic() + 60
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        with httpx.Client(base_url=url, timeout=30) as client:
            assert client.get("/p").text == "ok"
            before = server_side()
            with client.stream("GET", "/s") as r:
                lines = r.iter_lines()
                assert next(lines) == "data: 1"
                during = server_side()
                release.set()
                assert "data: [DONE]" in list(lines)
            assert client.get("/p").text == "ok"  # the same connection, kept alive
            after = server_side()
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
    assert during[1] == 8 * 1024 and before[1] == after[1] == 128 * 1024
    assert during[0] < 32 * 1024 <= before[0] == after[0]  # Linux reports twice what was set


def test_serve_and_the_gateway_run_on_uvloop_where_it_is_installed():
    uvloop = pytest.importorskip("uvloop")

    async def main() -> type:
        await asyncio.sleep(0)
        return type(asyncio.get_running_loop())

    assert listener.run(main()) is uvloop.Loop
