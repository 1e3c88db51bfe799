"""The chart's pool topology as real processes: two `loraplex serve` members started with
the arguments and environment the chart renders for topology=pool (only the model, the
port and the writable paths point into this machine), on one PostgreSQL database and its
adapter store. Each answers the official OpenAI client with the adapter in `model` and
serves the endpoint picker's metrics on the InferencePool's target port; one quota and
one usage ledger hold across the members."""
from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import helm_python as helm
import httpx
import openai
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from loraplex.engine.config import EngineConfig, ModelConfig
from loraplex.platform.db.database import Database, migrate
from loraplex.platform.quotas.limits import set_quota
from loraplex.platform.settings import Settings
from loraplex.platform.tenancy.adapter_registry import add_adapter, open_store, shared_blob_store
from loraplex.platform.tenancy.tenants import create_key, create_tenant
from tests.e2e.fleet import processes as P
from tests.e2e.usage_support import export_events
from tests.platform.fixtures import pg_schema_url, tiny_adapters  # noqa: F401 - fixtures

CHART = Path(__file__).resolve().parents[2] / "helm" / "loraplex"
CACHE = "/var/cache/loraplex"  # the pods' cache volume, where the chart puts every writable path
GREEDY = {"temperature": 0, "max_tokens": 8}


def _rendered_member(tiny_llama_dir: Path, port: int) -> tuple[dict, dict]:
    """(the pool Deployment's container, the InferencePool) rendered for a CPU pool."""
    values = {"topology": "pool", "cpuOnly": True, "inferencePool": {"endpointPicker": {"name": "epp"}},
              "model": {"source": "image", "path": str(tiny_llama_dir)}, "pool": {"port": port},
              "worker": {"engine": {"dtype": "float32", "threads": 1, "maxNumSeqs": 16, "maxModelLen": 256,
                                    "maxNumBatchedTokens": 256, "maxLoras": 2, "maxLoraRank": 16}}}
    files = helm.Chart.load(str(CHART)).render(values, name="lpx", namespace="serving", is_install=True)
    docs = [d for name, text in files.items() if name.endswith(".yaml") for d in yaml.safe_load_all(text) if d]
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"
                     and d["metadata"]["labels"]["app.kubernetes.io/component"] == "pool"]
    (pool,) = [d for d in docs if d["kind"] == "InferencePool"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container, pool


def _member(tiny_llama_dir: Path, logs: Path, name: str, db_url: str) -> tuple[P.Proc, int]:
    port = P.free_port()
    container, pool = _rendered_member(tiny_llama_dir, port)
    here = str(logs / name)
    secrets = {"database-url": db_url, "admin-token": P.ADMIN_TOKEN}
    env = {e["name"]: e["value"].replace(CACHE, here) if "value" in e else secrets[e["valueFrom"]["secretKeyRef"]["key"]]
           for e in container["env"]}
    argv = [a.replace(CACHE, here) for a in container["args"]]
    assert argv[0] == "serve" and pool["spec"]["targetPorts"] == [{"number": port}]
    return P.Proc(name, argv, port, logs / f"{name}.log", env=env), pool["spec"]["targetPorts"][0]["number"]


@pytest.fixture(scope="module")
def pool(pg_schema_url, tiny_llama_dir, tiny_adapters, tmp_path_factory) -> Iterator[tuple[Database, list]]:  # noqa: F811
    logs = tmp_path_factory.mktemp("pool")
    url = pg_schema_url()
    migrate(url)
    db = Database(url)
    settings = Settings(engine=EngineConfig(model=ModelConfig(model=str(tiny_llama_dir))), database_url=url,
                        data_dir=logs / "registry")
    store, blobs = open_store(settings), shared_blob_store(settings, db)
    for name in ("ad1", "ad2"):
        add_adapter(db, store, name, tiny_adapters[name], public=True, blobs=blobs)
    members = [_member(tiny_llama_dir, logs, f"member{i}", url) for i in range(2)]
    try:
        for proc, _ in members:
            proc.start()
        for proc, _ in members:
            proc.wait_ready()
        yield db, members
    finally:
        for proc, _ in members:
            try:
                proc.stop()
            except RuntimeError:
                pass
        db.dispose()


def _tenant(db: Database, **limits) -> tuple[str, str]:
    name = f"t-{uuid.uuid4().hex[:6]}"
    create_tenant(db, name)
    if limits:
        set_quota(db, name, **limits)
    return name, create_key(db, name)


def _client(proc: P.Proc, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{proc.port}/v1", api_key=key, max_retries=0, timeout=120)


def test_members_speak_openai_with_the_adapter_in_model_on_the_target_port(pool):
    db, members = pool
    _, key = _tenant(db)
    texts = set()
    for proc, target in members:
        assert proc.port == target
        c = _client(proc, key)
        texts.add(c.completions.create(model="ad1", prompt="The pool", **GREEDY).choices[0].text)
        chat = c.chat.completions.create(model="ad2", messages=[{"role": "user", "content": "hi"}], **GREEDY)
        assert chat.choices[0].message.content is not None
        assert {"ad1", "ad2"} <= {m.id for m in c.models.list().data}
    assert len(texts) == 1  # one model, one adapter version, greedy: the same text from either member


def test_members_serve_the_endpoint_pickers_metrics_on_the_target_port(pool):
    db, members = pool
    _, key = _tenant(db)
    for proc, target in members:
        _client(proc, key).completions.create(model="ad1", prompt="metrics", max_tokens=2)
        text = httpx.get(f"http://127.0.0.1:{target}/metrics", timeout=30).text
        families = {f.name: f for f in text_string_to_metric_families(text)}
        for name in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc"):
            assert families[name].type == "gauge" and families[name].samples
        (cache,) = families["vllm:cache_config_info"].samples
        assert cache.labels["block_size"] == "16" and int(cache.labels["num_gpu_blocks"]) > 0
        (info,) = families["vllm:lora_requests_info"].samples
        assert info.labels["max_lora"] == "2"
        loaded = {s.labels["adapter_name"]: s.labels["level"] for s in families["vllm:lora_adapter_loaded"].samples}
        assert loaded.get("ad1") == "gpu", loaded


def test_one_quota_and_one_ledger_across_the_members(pool):
    db, members = pool
    tenant, key = _tenant(db, rpm=4)
    if time.time() % 60 > 50:  # all ten requests inside one rate window
        time.sleep(60 - time.time() % 60 + 0.2)
    statuses = []
    for i in range(10):
        try:
            _client(members[i % 2][0], key).completions.create(model="ad1", prompt="q", max_tokens=1)
            statuses.append(200)
        except openai.RateLimitError:
            statuses.append(429)
    assert statuses.count(200) == 4 and statuses.count(429) == 6, statuses
    deadline = time.monotonic() + 60  # usage events reach the database through each member's writer
    while len(events := export_events(db, tenant)) < 4:
        assert time.monotonic() < deadline, events
        time.sleep(0.2)
    assert len(events) == 4 and {e["adapter"] for e in events} == {"ad1"}


def test_an_adapter_uploaded_through_one_member_is_served_by_the_other(pool, tiny_adapters):
    db, members = pool
    _, key = _tenant(db)
    files = [("files", (n, (tiny_adapters["ad3"] / n).read_bytes()))
             for n in ("adapter_config.json", "adapter_model.safetensors")]
    r = httpx.post(f"http://127.0.0.1:{members[0][0].port}/admin/api/adapters", data={"name": "ad3", "public": "true"},
                   files=files, headers={"authorization": f"Bearer {P.ADMIN_TOKEN}"}, timeout=60)
    assert r.status_code == 201, r.text
    other = _client(members[1][0], key)
    deadline = time.monotonic() + 15  # the other member sees the new name within its caches' TTLs
    while True:
        try:
            out = other.completions.create(model="ad3", prompt="Uploaded", **GREEDY)
            break
        except openai.NotFoundError:
            assert time.monotonic() < deadline, "the other member never served the adapter"
            time.sleep(0.5)
    assert out.choices[0].text == _client(members[0][0], key).completions.create(
        model="ad3", prompt="Uploaded", **GREEDY).choices[0].text
