"""Adapter versions by digest from a shared `BlobStore` (fetched on first use, verified,
cached): the LoRA manager's source on an engine worker, and behind a `serve` replica's
disk store when replicas share a store."""
from __future__ import annotations

from pathlib import Path

import torch

from .blobs import BlobStore, BlobStoreConfig, CachedBlobStore, load_blob, open_blob_store
from .peft import LoRAAdapter
from .shapes import BaseShapes


class BlobAdapterSource:
    """The LoRA manager's `AdapterSource` over a `BlobStore`: `load(digest)` fetches the
    blob on first use (verified, cached under the store's cache folder) and loads it.
    It resolves no names: whoever sends a request names its version (digest)."""

    def __init__(self, store: BlobStore, base: BaseShapes, max_rank: int) -> None:
        self.store = store
        self.base = base
        self.max_rank = max_rank

    def load(self, digest: str, dtype: torch.dtype = torch.float32) -> LoRAAdapter:
        return load_blob(self.store, digest, self.base, dtype, max_rank=self.max_rank)

    def evict(self, digest: str) -> None:
        """Drop the local copy of a remote blob (the store keeps it), unless it is being read."""
        if isinstance(self.store, CachedBlobStore):
            self.store.evict(digest)


def open_source(url: str, model_dir: Path, cache_dir: Path, max_rank: int,
                s3_endpoint_url: str | None = None, *, cache_max_bytes: int | None = None) -> BlobAdapterSource:
    """The source over the store `url` names (see `open_blob_store`), for the model in `model_dir`;
    at most `cache_max_bytes` of fetched blobs stay in `cache_dir` (None: unbounded)."""
    config = BlobStoreConfig(url, cache_dir=cache_dir, s3_endpoint_url=s3_endpoint_url, cache_max_bytes=cache_max_bytes)
    store = open_blob_store(config)
    return BlobAdapterSource(store, BaseShapes.from_model_dir(model_dir), max_rank)
