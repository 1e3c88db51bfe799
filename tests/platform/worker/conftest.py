"""A tiny engine whose adapters come from a SQL blob store, as a worker builds it."""
from __future__ import annotations

import pytest

from tests.platform.fixtures import tiny_adapters  # noqa: F401


@pytest.fixture(scope="module")
def blob_engine(tmp_path_factory, tiny_llama_dir, tiny_adapters):  # noqa: F811
    """(LLMEngine over a BlobAdapterSource, {name: digest} of the blobs stored)."""
    from loraplex.adapters import AdapterStore, BaseShapes
    from loraplex.engine.config import CacheConfig, EngineConfig, LoRAConfig, ModelConfig
    from loraplex.engine.engine import LLMEngine
    from loraplex.engine.lora import LoRAManager
    from loraplex.platform.db import migrate
    from loraplex.adapters.sources import open_source

    tmp = tmp_path_factory.mktemp("worker-blobs")
    url = f"sqlite:///{tmp / 'blobs.db'}"
    migrate(url)
    local = AdapterStore(tmp / "validated", BaseShapes.from_model_dir(tiny_llama_dir))
    source = open_source(url, tiny_llama_dir, tmp / "cache", max_rank=16)
    digests = {}
    for name in ("ad1", "ad2"):
        digests[name] = local.add(name, tiny_adapters[name]).digest
        source.store.put(digests[name], local.blob_files(digests[name]))
    cfg = EngineConfig(model=ModelConfig(model=str(tiny_llama_dir), dtype="float32", max_model_len=128),
                       cache=CacheConfig(num_blocks=32, block_size=16), lora=LoRAConfig(max_loras=1, max_lora_rank=16),
                       num_threads=1)
    return LLMEngine(cfg, LoRAManager(source, cfg.lora)), digests
