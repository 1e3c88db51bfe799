"""`loraplex worker --metrics-port`: /metrics on a listener of its own, so a network policy
can let scrapers reach it and not the internal API. A real worker process on the tiny
model, over loopback (tests/e2e/test_worker.py starts it the same way)."""
from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest

from tests.e2e.test_worker import AUTH, ENGINE_ARGS, TOKEN, WORKER_MAX_LEN, Worker, _free_port, gen_body


def _metrics_client(w: Worker, port: int, timeout: float = 60) -> httpx.Client:
    """A client of the worker's metrics listener, once it accepts connections."""
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if w.proc.poll() is not None:
            raise AssertionError(f"the worker exited ({w.proc.returncode}):\n{w.output()}")
        try:
            client.get("/metrics")
            return client
        except httpx.TransportError:
            time.sleep(0.2)
    raise AssertionError(f"nothing listens on the metrics port {port}:\n{w.output()}")


def _start(tmp: Path, model_dir: Path) -> tuple[Worker, httpx.Client]:
    port = _free_port()
    w = Worker(tmp, "--model", str(model_dir), "--database-url", f"sqlite:///{tmp / 'none.db'}",
               "--metrics-port", str(port), *ENGINE_ARGS)
    try:
        w.wait_ready()
        return w, _metrics_client(w, port)
    except BaseException:
        w.stop()
        raise


@pytest.fixture(scope="module")
def worker(tmp_path_factory, tiny_llama_dir) -> Iterator[tuple[Worker, httpx.Client]]:
    w, metrics = _start(tmp_path_factory.mktemp("worker-metrics"), tiny_llama_dir)
    try:
        yield w, metrics
    finally:
        metrics.close()
        w.stop()


def test_metrics_answer_on_their_own_port_with_the_token_only(worker):
    w, metrics = worker
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": TOKEN}):
        r = metrics.get("/metrics", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError"  # its series name adapters
    r = metrics.get("/metrics", headers=AUTH)
    assert r.status_code == 200 and "vllm:num_requests_running" in r.text


def test_the_main_port_no_longer_serves_metrics_and_the_metrics_port_nothing_else(worker):
    w, metrics = worker
    assert w.http.get("/metrics", headers=AUTH).status_code == 404
    assert w.http.get("/internal/v1/stats", headers=AUTH).status_code == 200  # the internal API stays
    assert w.http.get("/ready").status_code == 200
    for path in ("/internal/v1/stats", "/ready", "/health"):
        assert metrics.get(path, headers=AUTH).status_code == 404, path


def test_a_draining_worker_is_still_scraped_then_exits_0(tmp_path, tiny_llama_dir):
    w, metrics = _start(tmp_path, tiny_llama_dir)
    try:
        body = gen_body("in-flight", [1, 2, 3, 4, 5, 6, 7, 8], WORKER_MAX_LEN // 2)  # running when SIGTERM comes
        with w.http.stream("POST", "/internal/v1/generate", json=body, headers=AUTH) as r:
            lines = r.iter_lines()
            assert orjson.loads(next(line for line in lines if line))["type"] == "output"
            w.proc.send_signal(signal.SIGTERM)
            probe = httpx.Client(base_url=w.url, timeout=30)
            assert probe.get("/ready").status_code == 503  # draining from here on
            probe.close()
            running = metrics.get("/metrics", headers=AUTH)
            assert running.status_code == 200 and "vllm:num_requests_running" in running.text
            rest = [orjson.loads(line) for line in lines if line]
        assert rest[-2]["finished"] and rest[-2]["finish_reason"] == "length"
        assert rest[-1]["type"] == "stats" and rest[-1]["draining"]
        assert w.proc.wait(60) == 0, w.output()
        with pytest.raises(httpx.TransportError):  # the metrics listener went with the worker
            metrics.get("/metrics", headers=AUTH)
    finally:
        metrics.close()
        w.stop()
