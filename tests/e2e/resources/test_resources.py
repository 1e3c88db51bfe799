"""One client must never starve the others: oversized bodies and prompts, streams cut
early, slowloris connections, a zip bomb and a catastrophic regex against a real
`loraplex serve`. The tests assert refusals and health; benchmarks/bench_resilience.py
measures /health latency under the same attacks."""
from __future__ import annotations

import json
import select
import socket
import threading
import time
from pathlib import Path

import httpx

from tests.adapters.test_untrusted import CATASTROPHIC, deflated, write_raw_zip, zeros_deflate
from tests.e2e.resources.conftest import ADMIN_TOKEN, MAX_BODY, Served

FIFTY_MB = 50 << 20


def _read_response(s: socket.socket) -> tuple[int, dict, bytes]:
    """(status, headers, body) of one HTTP/1.1 response, read until it is complete or closed."""
    data = b""
    s.settimeout(60)
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:])}
    need = int(headers.get("content-length", "0"))
    while len(body) < need:
        chunk = s.recv(65536)
        if not chunk:
            break
        body += chunk
    return int(lines[0].split()[1]), headers, body


def _post_streaming(served: Served, path: str, headers: dict[str, str], total: int, declared: bool) -> tuple[int, dict]:
    """POST `total` bytes of JSON-ish filler, declared by Content-Length or sent chunked, and
    stop sending as soon as the server answers. Returns (status, error body)."""
    head = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/json"]
    head += [f"{k}: {v}" for k, v in headers.items()]
    head.append(f"Content-Length: {total}" if declared else "Transfer-Encoding: chunked")
    piece = b"x" * (64 << 10)
    frame = piece if declared else b"%x\r\n%s\r\n" % (len(piece), piece)
    with socket.create_connection(("127.0.0.1", served.port), timeout=60) as s:
        s.sendall(("\r\n".join(head) + "\r\n\r\n").encode())
        sent = 0
        while sent < total:
            readable, _, _ = select.select([s], [], [], 0.002)
            if readable:
                break
            try:
                s.sendall(frame)
            except OSError:
                break
            sent += len(piece)
        status, resp_headers, body = _read_response(s)
    assert sent < total, "the server read the whole oversized body"
    assert resp_headers.get("content-type", "").startswith("application/json")
    return status, json.loads(body)


def test_fifty_megabyte_bodies_are_refused_before_they_are_read(served: Served):
    key = {"Authorization": f"Bearer {served.key}"}
    for path in ("/v1/chat/completions", "/v1/completions"):
        for headers in (key, {}):
            status, err = _post_streaming(served, path, headers, FIFTY_MB, declared=True)
            assert status == 413 and err["error"]["code"] == "payload_too_large", err
    # Sent chunked, with no size declared: refused once past the limit.
    status, err = _post_streaming(served, "/v1/chat/completions", key, FIFTY_MB, declared=False)
    assert status == 413 and str(MAX_BODY) in err["error"]["message"], err
    # Without a key, a chunked body is not read at all.
    status, err = _post_streaming(served, "/v1/chat/completions", {}, FIFTY_MB, declared=False)
    assert status == 401, err
    # The unauthenticated sign-in, and the admin API.
    status, err = _post_streaming(served, "/admin/api/session", {}, FIFTY_MB, declared=True)
    assert status == 413, err
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    status, err = _post_streaming(served, "/admin/api/tenants", admin, FIFTY_MB, declared=False)
    assert status == 413, err
    assert served.healthy()


def _poll_health(served: Served, stop: threading.Event, answers: list[int]) -> None:
    with httpx.Client(timeout=60) as client:
        while not stop.is_set():
            answers.append(client.get(f"{served.url}/health").status_code)


def test_an_eight_megabyte_prompt_is_refused_while_health_answers(served: Served):
    stop, answers = threading.Event(), []
    poller = threading.Thread(target=_poll_health, args=(served, stop, answers))
    poller.start()
    try:
        r = httpx.post(f"{served.url}/v1/completions", headers={"Authorization": f"Bearer {served.key}"},
                       json={"model": served.model, "prompt": "lorem ipsum " * (8 << 17)}, timeout=120)
        chat = httpx.post(f"{served.url}/v1/chat/completions", headers={"Authorization": f"Bearer {served.key}"},
                          json={"messages": [{"role": "user", "content": "x" * (8 << 20)}]}, timeout=120)
    finally:
        stop.set()
        poller.join()
    for resp in (r, chat):
        assert resp.status_code == 413 and resp.json()["error"]["code"] == "context_length_exceeded", resp.text
    assert answers and set(answers) == {200}


def test_streams_cut_early_release_the_engine_and_the_reservations(served: Served):
    body = json.dumps({"model": served.model, "prompt": "count with me", "max_tokens": 200, "ignore_eos": True,
                       "stream": True}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {served.key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    socks = []
    for _ in range(64):
        s = socket.create_connection(("127.0.0.1", served.port), timeout=120)
        s.sendall(head + body)
        socks.append(s)
    for s in socks:  # every stream has started: its first event arrived
        data = b""
        while b"data:" not in data:
            chunk = s.recv(4096)
            assert chunk, "a stream ended before its first event"
            data += chunk
        assert data.startswith(b"HTTP/1.1 200")
    for s in socks:
        s.close()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (served.engine_gauges() != (0.0, 0.0) or served.in_flight() != 0):
        time.sleep(0.1)
    assert served.engine_gauges() == (0.0, 0.0)
    assert served.in_flight() == 0
    assert served.healthy()


def test_slowloris_connections_do_not_block_others(served: Served):
    request = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Padding: " + b"a" * 64
    slow = [socket.create_connection(("127.0.0.1", served.port), timeout=60) for _ in range(100)]
    closed: set[int] = set()
    answers = []
    with httpx.Client(timeout=60) as client:
        for i in range(len(request)):  # one byte per connection per round, headers never finished
            for n, s in enumerate(slow):
                if n in closed:
                    continue
                try:
                    s.sendall(request[i:i + 1])
                except OSError:
                    closed.add(n)
            answers.append(client.get(f"{served.url}/health").status_code)
            answers.append(client.get(f"{served.url}/v1/models",
                                      headers={"Authorization": f"Bearer {served.key}"}).status_code)
            time.sleep(0.05)
            if len(closed) == len(slow):
                break
    assert set(answers) == {200}
    # The server drops connections whose headers never finish (--header-timeout 2).
    deadline = time.monotonic() + 60
    for n, s in enumerate(slow):
        s.settimeout(max(0.1, deadline - time.monotonic()))
        try:
            assert s.recv(1) == b"", "a slow connection got an answer"
        except ConnectionResetError:
            pass
        s.close()
    assert served.healthy()


def _upload(served: Served, name: str, files: list[tuple[str, bytes]]) -> httpx.Response:
    return httpx.post(f"{served.url}/admin/api/adapters", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
                      data={"name": name}, files=[("files", (n, b)) for n, b in files], timeout=120)


def test_zip_bomb_upload_is_refused(served: Served, tiny_adapters, tmp_path: Path):
    config = (tiny_adapters["ad1"] / "adapter_config.json").read_bytes()
    bomb = write_raw_zip(tmp_path / "bomb.zip", [
        ("adapter_config.json", *deflated(config)),
        ("adapter_model.safetensors", zeros_deflate(3900), 3900 << 20, 0),
    ])
    r = _upload(served, "bomb", [("bomb.zip", bomb.read_bytes())])
    assert r.status_code in (400, 413) and r.json()["error"]["message"], r.text
    listed = httpx.get(f"{served.url}/admin/api/adapters", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
    assert "bomb" not in {a["name"] for a in listed.json()}
    assert served.healthy()


def test_catastrophic_regex_adapter_config_is_refused(served: Served, tiny_adapters):
    config = json.loads((tiny_adapters["ad1"] / "adapter_config.json").read_text())
    config["target_modules"] = CATASTROPHIC
    weights = (tiny_adapters["ad1"] / "adapter_model.safetensors").read_bytes()
    r = _upload(served, "regex", [("adapter_config.json", json.dumps(config).encode()),
                                  ("adapter_model.safetensors", weights)])
    assert r.status_code == 400 and "target_modules" in r.json()["error"]["message"], r.text
    assert served.healthy()


def test_an_oversized_request_head_is_refused(served: Served):
    with socket.create_connection(("127.0.0.1", served.port), timeout=60) as s:
        try:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * (100 << 10) + b"\r\n\r\n")
        except OSError:
            pass  # closed as soon as the head passed its limit
        status, _, _ = _read_response(s)
    assert status == 400
    assert served.healthy()
