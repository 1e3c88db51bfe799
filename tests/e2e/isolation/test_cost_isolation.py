"""What one client sends (bad keys, trickled bodies, early-refused bodies, many
connections) must not lock out or slow down the others: each vector against a real
`loraplex serve` with two tenants. The assertions are properties (who is served, what is
refused with which status, which connection is closed), never timings;
benchmarks/bench_isolation.py measures the cost to a streaming tenant."""
from __future__ import annotations

import contextlib
import json
import select
import socket
import time

import httpx
import openai
import pytest

from loraplex.platform.tenancy.tenants import create_key
from tests.e2e.isolation.conftest import ADMIN_TOKEN, BODY_RATE, MAX_BODY, MAX_CONNECTIONS, PER_CLIENT, Isolated
from tests.e2e.resources.test_resources import _read_response

JUNK = "lpx_0123456789ab_" + "j" * 43
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}


def _until(condition, what: str, timeout: float = 120.0):
    """Poll `condition` until it returns something truthy (a busy machine: no fixed sleeps)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = condition()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _throttle(http: httpx.Client, path: str, auth: str, statuses: set[int]) -> None:
    """Send bad credentials from `http`'s address until it gets 429."""
    for _ in range(200):
        status = http.get(path, headers={"Authorization": auth}).status_code
        statuses.add(status)
        if status == 429:
            return
    raise AssertionError(f"never throttled: {statuses}")


def _closed(s: socket.socket, timeout: float = 60.0) -> bool:
    """True once the server closed `s` (EOF or reset), reading and dropping what it sends."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        readable, _, _ = select.select([s], [], [], 0.5)
        if readable:
            try:
                if s.recv(65536) == b"":
                    return True
            except (ConnectionResetError, BrokenPipeError):
                return True
    return False


def test_a_valid_key_is_served_from_an_address_flooding_junk_keys(isolated: Isolated):
    statuses: set[int] = set()
    beta = isolated.openai("beta")
    with isolated.http() as flood:
        _throttle(flood, "/v1/models", f"Bearer {JUNK}", statuses)
        assert statuses == {401, 429}
        for i in range(10):  # junk and valid keys interleaved from the same address
            junk = flood.get("/v1/models", headers={"Authorization": f"Bearer lpx_0123456789{i:02d}_" + "z" * 43})
            assert junk.status_code == 429 and junk.json()["error"]["type"] == "rate_limit_error"
            assert "retry-after" in junk.headers
            got = beta.chat.completions.create(model=isolated.model, **CHAT)
            assert got.choices[0].message.content is not None
        # A key made elsewhere (the CLI, another replica) is served from the throttled
        # address once this replica's known keys are refreshed (Settings.auth.cache_ttl).
        late = isolated.openai("acme", key=create_key(isolated.db, "acme"))

        def served() -> bool:
            try:
                return bool(late.models.list().data)
            except openai.RateLimitError:
                return False

        _until(served, "a new key to be served from a throttled address")
        assert flood.get("/v1/models", headers={"Authorization": f"Bearer {JUNK}"}).status_code == 429
    # Another address was never throttled.
    with isolated.http("127.0.0.2") as other:
        assert other.get("/v1/models", headers={"Authorization": f"Bearer {JUNK}"}).status_code == 401


def test_an_admin_session_keeps_working_while_its_address_is_throttled(isolated: Isolated):
    with isolated.http("127.0.0.5") as browser:
        signed = browser.post("/admin/api/session", json={"token": ADMIN_TOKEN})
        assert signed.status_code == 201
        statuses: set[int] = set()
        with isolated.http("127.0.0.5") as attacker:
            _throttle(attacker, "/admin/api/tenants", "Bearer not-the-admin-token-at-all", statuses)
            # Bearer tokens from the address stay throttled, the right one too (brute force).
            still = attacker.get("/admin/api/tenants", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
            assert still.status_code == 429
        tenants = browser.get("/admin/api/tenants")
        assert tenants.status_code == 200, tenants.text
        assert {"acme", "beta"} <= {t["name"] for t in tenants.json()}


def _post_head(isolated: Isolated, s: socket.socket, declared: int, key: str | None) -> None:
    head = ["POST /v1/chat/completions HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/json",
            f"Content-Length: {declared}"]
    if key:
        head.append(f"Authorization: Bearer {key}")
    s.sendall(("\r\n".join(head) + "\r\n\r\n").encode())


def test_a_trickled_body_is_cut_off_by_its_deadline(isolated: Isolated):
    """A byte every 0.1 s re-armed a per-chunk timeout forever; the body deadline
    (--body-timeout plus one second per --body-min-rate bytes) closes the connection."""
    declared = 100_000
    with isolated.connect("127.0.0.6") as s:
        _post_head(isolated, s, declared, isolated.keys["acme"])
        sent = 0
        while sent < declared:
            try:
                s.sendall(b" ")
            except OSError:
                break
            sent += 1
            readable, _, _ = select.select([s], [], [], 0.1)
            if readable:
                break
        assert _closed(s)
        assert sent < declared
    with isolated.http("127.0.0.6") as http:
        assert http.get("/health").status_code == 200


@pytest.mark.parametrize("case", ["401 without a key", "413 declared too large"])
def test_an_early_error_closes_the_connection_instead_of_reading_the_body(isolated: Isolated, case: str):
    declared, key, status = ((MAX_BODY // 2, None, 401) if case.startswith("401")
                             else (MAX_BODY * 8, isolated.keys["acme"], 413))
    with isolated.connect("127.0.0.7") as s:
        _post_head(isolated, s, declared, key)
        s.sendall(b"{" + b" " * 4096)
        got, headers, body = _read_response(s)
        assert got == status, body
        assert headers.get("connection") == "close"
        assert json.loads(body)["error"]["code"] in ("invalid_api_key", "payload_too_large")
        assert _closed(s)  # without the rest of the declared body


@contextlib.contextmanager
def _held(isolated: Isolated, source: str, n: int):
    """`n` idle connections from `source`, closed on exit (and seen closed by the server)."""
    socks = [isolated.connect(source) for _ in range(n)]
    try:
        yield socks
    finally:
        for s in socks:
            s.close()


def _health_from(isolated: Isolated, source: str) -> int:
    with isolated.connect(source) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        try:
            return _read_response(s)[0]
        except ConnectionResetError:
            return 0


def test_one_address_is_capped_while_another_is_served(isolated: Isolated):
    with _held(isolated, "127.0.0.8", PER_CLIENT):
        with isolated.connect("127.0.0.8") as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            status, headers, body = _read_response(s)
            assert status == 429 and headers.get("connection") == "close"
            assert json.loads(body)["error"]["type"] == "rate_limit_error"
            assert _closed(s)
        got = isolated.openai("beta", "127.0.0.9").chat.completions.create(model=isolated.model, **CHAT)
        assert got.choices[0].message.content is not None
    # Its connections closed, the address is served again.
    _until(lambda: _health_from(isolated, "127.0.0.8") == 200, "the capped address to be served again")


def test_health_and_ready_answer_while_the_tenant_port_is_full(isolated: Isolated):
    sources = [f"127.0.1.{i}" for i in range(1, MAX_CONNECTIONS // PER_CLIENT + 1)]
    with contextlib.ExitStack() as stack:
        for source in sources:
            stack.enter_context(_held(isolated, source, PER_CLIENT))
        with isolated.http("127.0.2.1") as http:
            refused = http.get("/v1/models", headers={"Authorization": f"Bearer {isolated.keys['beta']}"})
            assert refused.status_code == 503
            assert http.get("/health").status_code == 200
            assert http.get("/ready").json()["status"] == "ready"
    key = {"Authorization": f"Bearer {isolated.keys['beta']}"}
    with isolated.http("127.0.2.1") as http:
        _until(lambda: http.get("/v1/models", headers=key).status_code == 200, "the port to have room again")


def test_a_tenant_over_its_body_budget_is_refused_before_its_body_is_read(isolated: Isolated):
    """Parsing JSON holds the interpreter lock whatever thread does it: a tenant sending
    big bodies back to back gets 429 from the Content-Length once its bytes per second are
    spent (the body is not read: the connection closes), and the other tenant is served."""
    big = json.dumps({**CHAT, "messages": [{"role": "user", "content": "x" * (MAX_BODY * 3 // 4)}]}).encode()
    head = {"Authorization": f"Bearer {isolated.keys['acme']}", "Content-Type": "application/json"}
    with isolated.http("127.0.3.1") as http:
        first = http.post("/v1/chat/completions", content=big, headers=head)
        assert first.status_code == 413  # read, parsed, and too long for the context
        second = http.post("/v1/chat/completions", content=big, headers=head)
    assert second.status_code == 429 and second.json()["error"]["type"] == "rate_limit_error"
    assert f"over {BODY_RATE} bytes per second" in second.json()["error"]["message"]
    assert float(second.headers["retry-after"]) >= 1
    assert second.headers.get("connection") == "close"
    beta = isolated.openai("beta", "127.0.3.2").chat.completions.create(model=isolated.model, **CHAT)
    assert beta.choices[0].finish_reason in {"length", "stop"}
