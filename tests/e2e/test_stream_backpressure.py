"""Backpressure through a live server: a streaming client that stops reading backs its
stream up through the connection's small buffers (`--stream-send-buffer`) into the
engine, which pauses the request; read again, the stream resumes and ends whole."""
from __future__ import annotations

import dataclasses
import json
import socket
import threading
import time

import uvicorn

from loraplex.platform.app import create_app
from loraplex.platform.assembly.engine_factory import build_engine
from loraplex.platform.db.database import Database, migrate
from loraplex.platform.serving.listener import uvicorn_config
from loraplex.platform.settings import Settings
from loraplex.platform.tenancy.tenants import create_key, create_tenant

from tests.e2e.conftest import MAX_MODEL_LEN, RecordingHooks


def _serve(settings: Settings, app) -> tuple[uvicorn.Server, threading.Thread, socket.socket]:
    """The app on the guarded listener (the send buffer is set there), on a free port."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn_config(app, settings, log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    return server, thread, sock


def _stop_reading_then_read(base_settings, tmp_path, limits, max_model_len: int = MAX_MODEL_LEN,
                            **engine_knobs) -> list[dict]:
    """A raw-socket client streams a completion of `max_model_len - 16` tokens, reads its
    head, then nothing until the engine has paused the request (it must not run to its
    end unread); then it reads the rest. Returns the stream's events."""
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    migrate(url)
    db = Database(url)
    create_tenant(db, "acme", "interactive")
    key = create_key(db, "acme")
    model = dataclasses.replace(base_settings.engine.model, max_model_len=max_model_len)
    cache = dataclasses.replace(base_settings.engine.cache, num_blocks=max(base_settings.engine.cache.num_blocks,
                                                                           max_model_len // 16 + 8))
    settings = dataclasses.replace(base_settings, database_url=url, limits=limits, data_dir=tmp_path / "data",
                                   engine=dataclasses.replace(base_settings.engine, model=model, cache=cache))
    engine = build_engine(settings)
    for name, value in engine_knobs.items():
        setattr(engine, name, value)
    server, thread, sock = _serve(settings, create_app(settings, engine, hooks=RecordingHooks()))
    try:
        body = json.dumps({"model": settings.model_name, "prompt": "x", "max_tokens": max_model_len - 16,
                           "stream": True, "ignore_eos": True, "temperature": 0}).encode()
        client = socket.socket()
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        client.settimeout(60)
        client.connect(sock.getsockname())
        client.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
                       f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        got = client.recv(256)  # then the client reads nothing
        assert got.startswith(b"HTTP/1.1 200")
        sched = engine.engine.scheduler
        deadline, seen = time.monotonic() + 120, False
        while not any(r.paused for r in list(sched.requests.values())):
            seen = seen or bool(sched.requests)
            assert not (seen and not sched.requests), "the stream ran to its end unread"
            assert time.monotonic() < deadline, "the stream was never paused"
            time.sleep(0.01)
        while b"data: [DONE]" not in got:  # reading again resumes it
            chunk = client.recv(65536)
            assert chunk, "the server closed the stream"
            got += chunk
        client.close()
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
        engine.shutdown()
        db.dispose()
    events = [json.loads(line[6:]) for line in got.decode().splitlines() if line.startswith("data: {")]
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert sum(1 for e in events if e["choices"][0]["text"]) > max_model_len // 2
    return events


def test_a_client_that_stops_reading_pauses_its_stream_until_it_reads_again(base_settings, tmp_path):
    """Its backlog of unread outputs pauses it (the tiny model's context holds a few
    hundred tokens, so the backlog that pauses is small here)."""
    limits = dataclasses.replace(base_settings.limits, send_buffer_bytes=4096, stream_send_buffer_bytes=4096)
    _stop_reading_then_read(base_settings, tmp_path, limits, pause_backlog=4, stall_seconds=3600)


def test_a_stream_buffers_little_whatever_the_connection_buffers(base_settings, tmp_path):
    """While a response streams its connection's buffers are `--stream-send-buffer`: with
    megabytes for other responses (which would take this whole stream unread), a client
    that stops reading is still found, its sender blocked, and its request paused. The
    small buffers fill within ~150 tokens; the stream is ~2,000 (~260 KB, well inside
    4 MiB), so however fast the engine runs, most of it is still to come when the
    sender has been blocked for `stall_seconds`."""
    limits = dataclasses.replace(base_settings.limits, send_buffer_bytes=4 * 2**20, stream_send_buffer_bytes=4096)
    _stop_reading_then_read(base_settings, tmp_path, limits, max_model_len=2048, pause_backlog=100_000,
                            stall_seconds=0.2)
