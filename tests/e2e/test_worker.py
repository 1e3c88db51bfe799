"""`loraplex worker` as a gateway drives it: a real process on the tiny model, over loopback.

Adapters come from a SQL blob store (the `adapter_blobs` table of a migrated database) by
digest; the oracle is the in-process engine's greedy output on the same folders.
"""
from __future__ import annotations

import base64
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest

from loraplex.platform.routing.view import WorkerStats, prefix_key
from tests.e2e.conftest import MAX_MODEL_LEN
from tests.helpers.otlp import OtlpCollector
from tests.adapters.test_blobs import BUCKET, s3_endpoint  # noqa: F401 - moto's server on loopback
from tests.platform.fixtures import pg_schema_url, tiny_adapters  # noqa: F401

TOKEN = "worker-test-secret"
AUTH = {"authorization": f"Bearer {TOKEN}"}
# Longer than the oracle's context, so a request meant to be cut short (aborted, or
# holding a seat while others queue) cannot run to its end first on a fast machine.
WORKER_MAX_LEN = 2048
ENGINE_ARGS = ["--dtype", "float32", "--threads", "1", "--max-model-len", str(WORKER_MAX_LEN), "--num-kv-blocks", "160",
               "--max-num-seqs", "8", "--max-loras", "2", "--max-lora-rank", "16"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Worker:
    """One `loraplex worker` process; its output goes to a log file (read on failure)."""

    def __init__(self, tmp: Path, *args: str, token: str | None = TOKEN, env: dict[str, str] | None = None) -> None:
        self._tmp, self._args = tmp, args
        self._env = {**{k: v for k, v in os.environ.items() if k != "LORAPLEX_INTERNAL_TOKEN"}, **(env or {})}
        if token is not None:
            self._env["LORAPLEX_INTERNAL_TOKEN"] = token
        self._start()

    def _start(self) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = self._tmp / f"worker-{self.port}.log"
        cmd = [sys.executable, "-u", "-c", "from loraplex.platform.cli.main import main; main()", "worker",
               "--port", str(self.port), "--cache-dir", str(self._tmp / "blob-cache"), *self._args]
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=self._env)
        self.http = httpx.Client(base_url=self.url, timeout=60)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_ready(self, timeout: float = 180, new_ports: int = 3) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                # The port was free when picked, but until the worker binds it (after its
                # model loads) another process may take it, e.g. as a connection's local
                # port: that is the test's race, not the worker's failure.
                if new_ports and "address already in use" in self.output():
                    new_ports -= 1
                    self.http.close()
                    self._start()
                    continue
                raise AssertionError(f"the worker exited ({self.proc.returncode}):\n{self.output()}")
            try:
                if self.http.get("/ready").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"the worker did not get ready:\n{self.output()}")

    def stop(self) -> None:
        self.http.close()
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)


def publish(url: str, tmp: Path, model_dir: Path, adapters: dict[str, Path], endpoint: str | None = None
            ) -> dict[str, str]:
    """Validate ad1 and ad2 and put their blobs in the shared store at `url`: name -> digest."""
    from loraplex.adapters import AdapterStore, BaseShapes, BlobStoreConfig, open_blob_store

    local = AdapterStore(tmp / "validated", BaseShapes.from_model_dir(model_dir))
    shared = open_blob_store(BlobStoreConfig(url, cache_dir=tmp / "writer-cache", s3_endpoint_url=endpoint))
    digests = {}
    for name in ("ad1", "ad2"):
        digest = local.add(name, adapters[name]).digest
        shared.put(digest, local.blob_files(digest))
        digests[name] = digest
    return digests


@pytest.fixture(scope="module")
def blob_store(tmp_path_factory, tiny_llama_dir, tiny_adapters) -> tuple[str, dict[str, str]]:  # noqa: F811
    """A migrated SQLite database whose adapter_blobs hold ad1 and ad2: (URL, name -> digest)."""
    from loraplex.platform.db import migrate

    tmp = tmp_path_factory.mktemp("blobs")
    url = f"sqlite:///{tmp / 'fleet.db'}"
    migrate(url)
    return url, publish(url, tmp, tiny_llama_dir, tiny_adapters)


@pytest.fixture(scope="module")
def worker(tmp_path_factory, tiny_llama_dir, blob_store) -> Iterator[Worker]:
    w = Worker(tmp_path_factory.mktemp("worker"), "--model", str(tiny_llama_dir), "--database-url", blob_store[0],
               *ENGINE_ARGS)
    try:
        w.wait_ready()
        yield w
    finally:
        w.stop()


@pytest.fixture(scope="module")
def oracle(tmp_path_factory, tiny_llama_dir, tiny_adapters):  # noqa: F811
    """The in-process engine over the same model and adapters (from a local store)."""
    from loraplex.adapters import AdapterStore, BaseShapes
    from loraplex.engine.config import CacheConfig, EngineConfig, LoRAConfig, ModelConfig
    from loraplex.engine.engine import LLMEngine
    from loraplex.engine.lora import LoRAManager

    tmp = tmp_path_factory.mktemp("oracle")
    store = AdapterStore(tmp, BaseShapes.from_model_dir(tiny_llama_dir))
    for name in ("ad1", "ad2"):
        store.add(name, tiny_adapters[name])
    cfg = EngineConfig(model=ModelConfig(model=str(tiny_llama_dir), dtype="float32", max_model_len=MAX_MODEL_LEN),
                       cache=CacheConfig(num_blocks=64, block_size=16), lora=LoRAConfig(max_loras=2, max_lora_rank=16),
                       num_threads=1)
    return LLMEngine(cfg, LoRAManager(store, cfg.lora))


def gen_body(rid: str, ids: list[int], max_tokens: int = 12, adapter: dict | None = None, **sampling) -> dict:
    return {"request_id": rid, "prompt_token_ids": ids, "lane": "interactive", "adapter": adapter,
            "sampling": {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, **sampling},
            "cache_salt": "tenant-1", "tenant": "acme"}


def stream_lines(http: httpx.Client, body: dict) -> tuple[httpx.Response, list[dict]]:
    with http.stream("POST", "/internal/v1/generate", json=body, headers=AUTH) as r:
        lines = [orjson.loads(line) for line in r.iter_lines() if line]
    return r, lines


@pytest.mark.parametrize("adapter", [None, "ad1"])
def test_streamed_generate_equals_the_in_process_engine(worker, oracle, blob_store, adapter):
    digests = blob_store[1]
    ids = oracle.tokenizer.encode("The worker streams what the engine says. " * 3)  # a full KV block or more
    ref = {"name": adapter, "digest": digests[adapter]} if adapter else None
    r, lines = stream_lines(worker.http, gen_body(f"eq-{adapter}", ids, 12, ref))
    assert r.status_code == 200 and r.headers["content-type"] == "application/x-ndjson"
    WorkerStats.from_json(orjson.loads(r.headers["x-loraplex-stats"]))
    outputs, last = lines[:-1], lines[-1]
    assert all(o["type"] == "output" for o in outputs) and last["type"] == "stats"
    assert outputs[-1]["finished"] and outputs[-1]["finish_reason"] == "length"
    assert outputs[-1]["num_output_tokens"] == 12 and outputs[-1]["num_prompt_tokens"] == len(ids)

    from loraplex.engine.request import AdapterRef, SamplingParams

    (want,) = oracle.generate([ids], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                              adapter=AdapterRef(adapter, digests[adapter]) if adapter else None)
    assert [t for o in outputs for t in o["new_token_ids"]] == want.new_token_ids
    assert "".join(o["new_text"] for o in outputs) == want.new_text
    stats = WorkerStats.from_json(last)
    if adapter:  # fetched from the blob store by digest, now resident
        assert stats.residency(digests[adapter]) > 0
    # The key the gateway routes this request by (by digest): the worker reports it as served.
    assert stats.max_loras == 2 and prefix_key("tenant-1", digests[adapter] if adapter else None, ids) in \
        stats.prefix_keys


def test_n_choices_cross_the_wire_apart(worker, oracle, blob_store):
    from loraplex.engine.request import AdapterRef, SamplingParams

    digests = blob_store[1]
    ids = oracle.tokenizer.encode("Choices share one prefill, then go their own way. " * 2)
    r, lines = stream_lines(worker.http, gen_body("n3", ids, 10, {"name": "ad2", "digest": digests["ad2"]},
                                                  temperature=1.0, seed=5, n=3))
    outputs = [o for o in lines if o["type"] == "output"]
    assert r.status_code == 200 and outputs[-1]["finished"] and sum(o["finished"] for o in outputs) == 1
    want = oracle.generate([ids], SamplingParams(max_tokens=10, temperature=1.0, seed=5, ignore_eos=True, n=3),
                           adapter=AdapterRef("ad2", digests["ad2"]))
    for choice in want:
        mine = [o for o in outputs if o["index"] == choice.index]
        assert [t for o in mine for t in o["new_token_ids"]] == choice.new_token_ids
        assert [o["finish_reason"] for o in mine if o["finish_reason"]] == ["length"]


@pytest.mark.parametrize("store", ["postgresql", "s3"])
def test_adapters_from_each_shared_store(request, tmp_path, tiny_llama_dir, tiny_adapters, oracle, store):  # noqa: F811
    from loraplex.engine.request import AdapterRef, SamplingParams
    from loraplex.platform.db import migrate

    if store == "postgresql":
        url = request.getfixturevalue("pg_schema_url")()
        migrate(url)
        args, env, endpoint = ["--database-url", url], {}, None
    else:
        endpoint = request.getfixturevalue("s3_endpoint")
        url = f"s3://{BUCKET}/{tmp_path.name}"
        args, env = ["--adapter-store", url], {"AWS_ENDPOINT_URL": endpoint}
    digests = publish(url, tmp_path, tiny_llama_dir, tiny_adapters, endpoint)
    w = Worker(tmp_path, "--model", str(tiny_llama_dir), *args, *ENGINE_ARGS, env=env)
    try:
        w.wait_ready()
        ids = oracle.tokenizer.encode("served from the shared store")
        ref = {"name": "ad2", "digest": digests["ad2"]}
        r, lines = stream_lines(w.http, gen_body("shared", ids, 8, ref))
        assert r.status_code == 200, r.text
        (want,) = oracle.generate([ids], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                                  adapter=AdapterRef("ad2", digests["ad2"]))
        assert [t for o in lines[:-1] for t in o["new_token_ids"]] == want.new_token_ids
    finally:
        w.stop()


def test_internal_routes_and_metrics_need_the_token(worker):
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": TOKEN}):
        r = worker.http.get("/internal/v1/stats", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError"
        r = worker.http.post("/internal/v1/generate", json=gen_body("noauth", [1, 2, 3]), headers=headers)
        assert r.status_code == 401
        assert worker.http.get("/metrics", headers=headers).status_code == 401  # its series name adapters
    assert worker.http.get("/internal/v1/stats", headers=AUTH).status_code == 200
    assert "vllm:num_requests_running" in worker.http.get("/metrics", headers=AUTH).text
    for probe in ("/health", "/ready"):
        assert worker.http.get(probe).status_code == 200


def test_wrong_tokens_are_throttled_and_the_right_one_never_is(tmp_path, tiny_llama_dir):
    """Past a burst of wrong internal tokens an address gets 429 with Retry-After; the
    shared secret from the same address still gets in."""
    w = Worker(tmp_path, "--model", str(tiny_llama_dir), "--database-url", f"sqlite:///{tmp_path / 'none.db'}",
               *ENGINE_ARGS)
    try:
        w.wait_ready()
        codes = [w.http.get("/metrics", headers={"authorization": f"Bearer guess-{i}"}).status_code for i in range(40)]
        assert set(codes[:20]) == {401} and codes[-1] == 429, codes
        refused = w.http.get("/internal/v1/stats", headers={"authorization": "Bearer guess-again"})
        assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1
        assert refused.json()["error"]["type"] == "RateLimitedError"
        assert w.http.get("/internal/v1/stats", headers=AUTH).status_code == 200
        assert w.http.get("/metrics", headers=AUTH).status_code == 200
    finally:
        w.stop()


def test_the_token_is_read_without_its_newline_and_a_short_one_is_refused(tmp_path, tiny_llama_dir, worker):
    """A Secret made from a file ends in a newline: gateway and worker strip it (the
    gateway's requests then get in); a token under 16 characters stops either role at
    start with a usage error (exit 2) that names the problem."""
    from loraplex.platform.fleet.config import FleetConfig
    from loraplex.platform.fleet.model_info import fetch_model_info

    env = {**os.environ, "LORAPLEX_INTERNAL_TOKEN": TOKEN + "\n"}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LORAPLEX_INTERNAL_TOKEN", TOKEN + "\n")
        _, info = fetch_model_info(FleetConfig(workers=worker.url, startup_wait_s=30), tmp_path / "model")
    assert info.max_model_len == WORKER_MAX_LEN
    secret = tmp_path / "token"
    secret.write_text(TOKEN + "\n")
    file_env = {k: v for k, v in env.items() if k != "LORAPLEX_INTERNAL_TOKEN"}
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("LORAPLEX_INTERNAL_TOKEN", raising=False)
        mp.setenv("LORAPLEX_INTERNAL_TOKEN_FILE", str(secret))
        assert FleetConfig(workers=worker.url).headers() == AUTH
    cli = [sys.executable, "-c", "from loraplex.platform.cli.main import main; main()"]
    for role in (["worker", "--host", "0.0.0.0", "--model", str(tiny_llama_dir)],
                 ["gateway", "--workers", worker.url, "--database-url", f"sqlite:///{tmp_path / 'gw.db'}",
                  "--data-dir", str(tmp_path / "gw")]):
        proc = subprocess.run([*cli, *role], env={**env, "LORAPLEX_INTERNAL_TOKEN": "shortsecret\n"},
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2, proc.stderr
        assert "internal token from $LORAPLEX_INTERNAL_TOKEN is too short (11 characters)" in proc.stderr
        assert "at least 16" in proc.stderr and "Traceback" not in proc.stderr
    proc = subprocess.run([*cli, "worker", "--model", str(tiny_llama_dir)],
                          env={**file_env, "LORAPLEX_INTERNAL_TOKEN_FILE": str(tmp_path / "missing")},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "LORAPLEX_INTERNAL_TOKEN_FILE: cannot read" in proc.stderr


@pytest.mark.parametrize("body", [
    b"not json", b"[]", b'{"request_id": 1, "prompt_token_ids": [1]}', b'{"request_id": "x"}',
    b'{"request_id": "x", "prompt_token_ids": []}', b'{"request_id": "x", "prompt_token_ids": ["a"]}',
    b'{"request_id": "x", "prompt_token_ids": [1], "sampling": {"max_tokens": "many"}}',
    b'{"request_id": "x", "prompt_token_ids": [1], "sampling": {"temperature": -1}}',
    b'{"request_id": "x", "prompt_token_ids": [1], "sampling": {"stop": [1]}}',
    b'{"request_id": "x", "prompt_token_ids": [1], "sampling": {"logit_bias": [[1, 2, 3]]}}',
    b'{"request_id": "x", "prompt_token_ids": [1], "sampling": {"warp": 9}}',
    b'{"request_id": "x", "prompt_token_ids": [1], "lane": "fast"}',
    b'{"request_id": "x", "prompt_token_ids": [1], "adapter": {"name": "a"}}',
    b'{"request_id": "x", "prompt_token_ids": [999999999]}',
    b'{"request_id": "x", "prompt_token_ids": [1], "surprise": true}',
])
def test_malformed_generate_bodies_get_400_with_the_error_body(worker, body):
    r = worker.http.post("/internal/v1/generate", content=body, headers=AUTH)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "InvalidRequestError" and r.json()["error"]["message"]


def test_other_malformed_bodies_and_unknown_digests(worker):
    for path, body in (("/internal/v1/abort", b"{}"), ("/internal/v1/abort", b"nope"),
                       ("/internal/v1/adapters/load", b'{"name": "x", "digest": "md5:1"}'),
                       ("/internal/v1/adapters/load", b"null")):
        r = worker.http.post(path, content=body, headers=AUTH)
        assert r.status_code == 400 and r.json()["error"]["type"] == "InvalidRequestError", (path, body, r.text)
    missing = {"name": "ghost", "digest": "sha256:" + "0" * 64}
    r = worker.http.post("/internal/v1/generate", json=gen_body("ghost", [1, 2], adapter=missing), headers=AUTH)
    assert r.status_code == 404 and r.json()["error"]["type"] == "AdapterNotFoundError"
    assert worker.http.get("/internal/v1/nothing", headers=AUTH).status_code == 404
    r = worker.http.post("/internal/v1/generate", json=gen_body("long", [1] * (WORKER_MAX_LEN + 1)), headers=AUTH)
    assert r.status_code == 413 and r.json()["error"]["type"] == "PromptTooLongError"


def _idle_stats(http: httpx.Client, timeout: float = 30) -> WorkerStats:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = WorkerStats.from_json(http.get("/internal/v1/stats", headers=AUTH).json())
        if stats.running == 0 and stats.waiting_total == 0:
            return stats
        time.sleep(0.05)
    raise AssertionError(f"the worker still runs requests: {stats}")


def _aborts(http: httpx.Client) -> float:
    for line in http.get("/metrics", headers=AUTH).text.splitlines():
        if line.startswith("vllm:request_success_total{") and 'finished_reason="abort"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_closing_the_connection_aborts_the_request(worker, oracle):
    before = _aborts(worker.http)
    ids = oracle.tokenizer.encode("a long answer nobody waits for")
    body = gen_body("gone", ids, WORKER_MAX_LEN - len(ids) - 1)
    with worker.http.stream("POST", "/internal/v1/generate", json=body, headers=AUTH) as r:
        first = next(line for line in r.iter_lines() if line)
        assert orjson.loads(first)["type"] == "output"
    _idle_stats(worker.http)
    assert _aborts(worker.http) == before + 1


def test_abort_route_ends_the_stream(worker, oracle):
    ids = oracle.tokenizer.encode("stop me")
    body = gen_body("to-abort", ids, WORKER_MAX_LEN - len(ids) - 1)
    with worker.http.stream("POST", "/internal/v1/generate", json=body, headers=AUTH) as r:
        lines = r.iter_lines()
        assert orjson.loads(next(line for line in lines if line))["type"] == "output"
        assert worker.http.post("/internal/v1/abort", json={"request_id": "to-abort"}, headers=AUTH).status_code == 204
        rest = [orjson.loads(line) for line in lines if line]
    assert rest[-1]["type"] == "stats" and rest[-2]["finished"] and rest[-2]["finish_reason"] == "abort"
    assert rest[-2]["num_output_tokens"] < body["sampling"]["max_tokens"]
    assert worker.http.post("/internal/v1/abort", json={"request_id": "unknown"}, headers=AUTH).status_code == 204
    _idle_stats(worker.http)


def test_adapter_load_and_unload_by_digest(worker, blob_store):
    digest = blob_store[1]["ad2"]
    r = worker.http.post("/internal/v1/adapters/load", json={"name": "ad2", "digest": digest}, headers=AUTH)
    assert r.status_code == 200 and r.json()["digest"] == digest
    assert digest in WorkerStats.from_json(worker.http.get("/internal/v1/stats", headers=AUTH).json()).cpu_adapters
    assert worker.http.delete(f"/internal/v1/adapters/{digest}", headers=AUTH).status_code == 204
    assert digest not in WorkerStats.from_json(worker.http.get("/internal/v1/stats", headers=AUTH).json()).cpu_adapters
    # Fetched again on the next use.
    r, lines = stream_lines(worker.http, gen_body("after-unload", [1, 2, 3], 2, {"name": "ad2", "digest": digest}))
    assert r.status_code == 200 and lines[-2]["finished"]


def test_a_version_in_use_keeps_serving_when_unloaded(worker, oracle, blob_store):
    from loraplex.engine.request import AdapterRef, SamplingParams

    digest = blob_store[1]["ad1"]
    ids = oracle.tokenizer.encode("keep my version")
    n = MAX_MODEL_LEN - len(ids) - 1
    with worker.http.stream("POST", "/internal/v1/generate", json=gen_body("held", ids, n, {"name": "ad1",
                            "digest": digest}), headers=AUTH) as r:
        lines = r.iter_lines()
        got = [orjson.loads(next(line for line in lines if line))]
        assert worker.http.delete(f"/internal/v1/adapters/{digest}", headers=AUTH).status_code == 204
        got += [orjson.loads(line) for line in lines if line]
    (want,) = oracle.generate([ids], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True),
                              adapter=AdapterRef("ad1", digest))
    assert got[-2]["finish_reason"] == "length"
    assert [t for o in got[:-1] for t in o["new_token_ids"]] == want.new_token_ids


def test_metrics_have_vllms_names_and_requests_per_adapter(worker, blob_store):
    stream_lines(worker.http, gen_body("metered", [5, 6, 7], 2, {"name": "ad1", "digest": blob_store[1]["ad1"]}))
    text = worker.http.get("/metrics", headers=AUTH).text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert f"\n{name}{{" in text
    info = next(line for line in text.splitlines() if line.startswith("vllm:lora_requests_info{"))
    assert 'max_lora="2"' in info and "running_lora_adapters=" in info and "waiting_lora_adapters=" in info
    assert 'loraplex:adapter_requests_total{adapter="ad1"}' in text


def test_metrics_tell_an_endpoint_picker_where_adapters_sit(tmp_path, tiny_llama_dir, blob_store):
    """One device slot: loading by name puts both versions in the CPU tier; running one
    moves it to the device (level "gpu"), running the other moves it out; unloading a
    version from the CPU tier takes its series away. Parsed with Prometheus's parser."""
    from prometheus_client.parser import text_string_to_metric_families

    url, digests = blob_store
    w = Worker(tmp_path, "--model", str(tiny_llama_dir), "--database-url", url, *ENGINE_ARGS, "--max-loras", "1")

    def scrape() -> dict:
        families = {f.name: f for f in text_string_to_metric_families(w.http.get("/metrics", headers=AUTH).text)}
        loaded = {s.labels["adapter_name"]: s.labels for s in families["vllm:lora_adapter_loaded"].samples}
        assert all(set(ls) == {"adapter_name", "level", "pinned"} and ls["pinned"] == "false" for ls in loaded.values())
        counts = {lvl: families[f"vllm:num_{lvl}_loaded_lora_adapters"].samples[0].value for lvl in ("gpu", "cpu")}
        return {"levels": {n: ls["level"] for n, ls in loaded.items()}, "counts": counts, "families": families}

    try:
        w.wait_ready()
        first = scrape()
        assert first["levels"] == {} and first["counts"] == {"gpu": 0, "cpu": 0}
        (cache,) = first["families"]["vllm:cache_config_info"].samples
        assert cache.labels == {"block_size": "16", "num_gpu_blocks": "160"} and cache.value == 1
        (info,) = first["families"]["vllm:lora_requests_info"].samples
        assert info.labels == {"running_lora_adapters": "", "waiting_lora_adapters": "", "max_lora": "1"}
        for name in ("ad1", "ad2"):
            r = w.http.post("/internal/v1/adapters/load", json={"name": name, "digest": digests[name]}, headers=AUTH)
            assert r.status_code == 200
        assert scrape()["levels"] == {"ad1": "cpu", "ad2": "cpu"}
        for name, want in (("ad1", {"ad1": "gpu", "ad2": "cpu"}), ("ad2", {"ad1": "cpu", "ad2": "gpu"})):
            r, lines = stream_lines(w.http, gen_body(f"run-{name}", [1, 2, 3], 2, {"name": name, "digest": digests[name]}))
            assert r.status_code == 200 and lines[-2]["finished"]
            got = scrape()
            assert got["levels"] == want and got["counts"] == {"gpu": 1, "cpu": 1}
        assert w.http.delete(f"/internal/v1/adapters/{digests['ad1']}", headers=AUTH).status_code == 204
        assert scrape()["levels"] == {"ad2": "gpu"}
    finally:
        w.stop()


def test_model_route_gives_the_gateway_a_tokenizer(worker, oracle, tmp_path):
    from loraplex.engine.tokenizer import Tokenizer

    doc = worker.http.get("/internal/v1/model", headers=AUTH).json()
    assert doc["max_model_len"] == WORKER_MAX_LEN and doc["eos_token_ids"] == list(oracle.tokenizer.eos_token_ids)
    for name, data in doc["tokenizer_files"].items():
        (tmp_path / name).write_bytes(base64.b64decode(data))
    text = "Tokenized the same on both sides"
    assert Tokenizer(tmp_path).encode(text) == oracle.tokenizer.encode(text)


def test_sigterm_drains_then_exits_0(tmp_path, tiny_llama_dir, oracle):
    w = Worker(tmp_path, "--model", str(tiny_llama_dir), "--database-url", f"sqlite:///{tmp_path / 'none.db'}",
               *ENGINE_ARGS)
    try:
        w.wait_ready()
        ids = oracle.tokenizer.encode("finish what you started")
        body = gen_body("in-flight", ids, WORKER_MAX_LEN // 2)  # still running when SIGTERM comes
        with w.http.stream("POST", "/internal/v1/generate", json=body, headers=AUTH) as r:
            lines = r.iter_lines()
            assert orjson.loads(next(line for line in lines if line))["type"] == "output"
            w.proc.send_signal(signal.SIGTERM)
            probe = httpx.Client(base_url=w.url, timeout=30)
            assert probe.get("/ready").status_code == 503
            refused = probe.post("/internal/v1/generate", json=gen_body("late", ids), headers=AUTH)
            assert refused.status_code == 503 and refused.json()["error"]["type"] == "ShuttingDownError"
            assert probe.get("/health").status_code == 200
            probe.close()
            rest = [orjson.loads(line) for line in lines if line]
        assert rest[-2]["finished"] and rest[-2]["finish_reason"] == "length"
        assert rest[-1]["type"] == "stats" and rest[-1]["draining"]
        assert w.proc.wait(60) == 0, w.output()
    finally:
        w.stop()


def test_refuses_a_non_loopback_host_without_the_token(tmp_path, tiny_llama_dir):
    w = Worker(tmp_path, "--host", "0.0.0.0", "--model", str(tiny_llama_dir), token=None)
    try:
        assert w.proc.wait(60) == 1
        assert "LORAPLEX_INTERNAL_TOKEN" in w.output()
    finally:
        w.stop()


def test_json_logs_and_spans_carry_the_request_id_and_the_trace_the_gateway_sent(tmp_path, tiny_llama_dir, oracle):
    collector = OtlpCollector()
    w = Worker(tmp_path, "--model", str(tiny_llama_dir), "--database-url", f"sqlite:///{tmp_path / 'none.db'}",
               *ENGINE_ARGS, "--log-format", "json", "--access-log", "--otlp-endpoint", collector.endpoint)
    try:
        w.wait_ready()
        rid = "gw-req-7f3a"  # what a gateway forwards in x-request-id, and its span in traceparent
        trace_id, parent_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
        headers = {**AUTH, "x-request-id": rid, "traceparent": f"00-{trace_id}-{parent_id}-01"}
        body = gen_body("cmpl-logged", oracle.tokenizer.encode("log this request"), 4)
        with w.http.stream("POST", "/internal/v1/generate", json=body, headers=headers) as r:
            assert r.status_code == 200 and r.headers["x-request-id"] == rid
            r.read()
        w.proc.send_signal(signal.SIGTERM)  # drains, then exports the spans still buffered
        assert w.proc.wait(60) == 0, w.output()
    finally:
        w.stop()
        collector.close()
    lines = [orjson.loads(line) for line in w.output().splitlines() if line.strip()]  # every line is JSON
    assert {"time", "level", "logger", "message"} <= set(lines[0])
    access = [x for x in lines if x["logger"] == "uvicorn.access" and "/internal/v1/generate" in x["message"]]
    assert [x.get("request_id") for x in access] == [rid]
    exported = collector.spans()
    assert {s.service for s in exported} == {"loraplex-worker"}
    spans = {s.name: s.attributes for s in exported}
    (request,) = [s for s in exported if s.name == "request"]
    assert (request.trace_id, request.parent_span_id) == (trace_id, parent_id)  # the gateway's trace continues
    assert {"request", "queue", "prefill", "decode"} <= set(spans)
    assert all(spans[name]["loraplex.request_id"] == rid for name in ("request", "queue", "prefill", "decode"))
    assert spans["request"]["loraplex.finish_reason"] == "length" and spans["request"]["loraplex.tenant"] == "acme"
