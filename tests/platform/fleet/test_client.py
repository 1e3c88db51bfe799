"""RemoteEngineClient's own parts, without workers: model description, adapter names
resolved in the registry, the fleet's stats summed, and no worker reachable -> 503."""
from __future__ import annotations

import asyncio
import base64

import pytest

from loraplex.engine.client import EngineClient
from loraplex.engine.errors import UnknownAdapterError
from loraplex.engine.request import AdapterRef, Lane, SamplingParams
from loraplex.platform.errors import api_error
from loraplex.platform.fleet.client import RemoteEngineClient
from loraplex.platform.fleet.config import FleetConfig
from loraplex.platform.tenancy.adapter_directory import AdapterDirectory
from loraplex.platform.fleet.errors import WorkerUnreachableError
from loraplex.platform.fleet.model_info import write_model_dir
from loraplex.platform.routing import RouterConfig, WorkerStats
from loraplex.platform.tenancy.adapter_registry import add_adapter
from loraplex.adapters import AdapterStore, BaseShapes
from tests.e2e.fleet.processes import free_port

DIGEST = "sha256:" + "b" * 64


def _model_doc(model_dir) -> dict:
    files = {p.name: base64.b64encode(p.read_bytes()).decode() for p in model_dir.iterdir()
             if p.suffix in (".json", ".txt") or p.name.startswith("tokenizer")}
    return {"model": "tiny", "max_model_len": 256, "vocab_size": 49152, "eos_token_ids": [2],
            "tokenizer_files": files, "max_lora_rank": 16, "max_loras": 4}


@pytest.fixture
def client(tmp_path, tiny_llama_dir, db):
    _, info = write_model_dir(_model_doc(tiny_llama_dir), tmp_path / "model")
    config = FleetConfig(workers=f"http://127.0.0.1:{free_port()},http://127.0.0.1:{free_port()}",
                         router=RouterConfig(health_interval_s=60))
    return RemoteEngineClient(config, info, AdapterDirectory(db))


def test_the_model_is_described_by_a_worker(client, tiny_llama_dir):
    assert isinstance(client, EngineClient)
    assert client.max_model_len == 256 and client.model_info().max_lora_rank == 16
    assert client.tokenizer.encode("hello world") == client.tokenizer.hf.encode("hello world")


def test_a_model_description_cannot_write_outside_its_folder(tmp_path, tiny_llama_dir):
    doc = _model_doc(tiny_llama_dir)
    doc["tokenizer_files"]["../evil.json"] = base64.b64encode(b"{}").decode()
    with pytest.raises(WorkerUnreachableError, match="bad name"):
        write_model_dir(doc, tmp_path / "model")


def test_adapter_names_resolve_in_the_registry(client, db, tmp_path, tiny_llama_dir, tiny_adapters):
    store = AdapterStore(tmp_path / "store", base=BaseShapes.from_model_dir(tiny_llama_dir))
    info = add_adapter(db, store, "ad1", tiny_adapters["ad1"], public=True)
    assert client.resolve_adapter("ad1") == AdapterRef("ad1", info.digest)
    with pytest.raises(UnknownAdapterError):
        client.resolve_adapter("nope")


def test_stats_sum_the_fleet(client):
    a, b = sorted(client.config.workers.split(","))
    client.pool.set_members([a, b])
    client.pool.update_stats(a, WorkerStats(running=2, waiting={"interactive": 1, "batch": 3}, kv_usage=0.5,
                                            device_adapters=frozenset({DIGEST}), max_loras=4))
    client.pool.update_stats(b, WorkerStats(running=1, waiting={"standard": 2}, kv_usage=0.1,
                                            cpu_adapters=frozenset({DIGEST, "sha256:" + "c" * 64}), max_loras=4))
    s = client.stats()
    assert (s.running, s.waiting, s.max_loras) == (3, 6, 4)
    assert {lane: d.waiting for lane, d in s.lanes.items()} == {Lane.INTERACTIVE: 1, Lane.STANDARD: 2, Lane.BATCH: 3}
    assert s.kv_cache_usage == pytest.approx(0.3)
    assert s.adapters.where() == {DIGEST: "device", "sha256:" + "c" * 64: "cpu"}


def test_no_reachable_worker_is_a_503_not_a_hang(client):
    async def run():
        await client.start()
        try:
            with pytest.raises(Exception) as caught:
                async for _ in client.generate([1, 2, 3], SamplingParams(max_tokens=2)):
                    pass
            return caught.value
        finally:
            await client.aclose()

    err = asyncio.run(run())
    assert api_error(err).status == 503
    assert client.pool.in_flight == 0
