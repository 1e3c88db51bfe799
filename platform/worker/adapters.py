"""A worker's adapters: versions fetched by digest from the shared store, verified, cached."""
from __future__ import annotations

from pathlib import Path

import torch

from loraplex.adapters import BaseShapes, BlobStore, BlobStoreConfig, LoRAAdapter, load_blob, open_blob_store
from loraplex.adapters.blobs import CachedBlobStore


class BlobAdapterSource:
    """The LoRA manager's `AdapterSource` over a `BlobStore`: `load(digest)` fetches the
    blob on first use (verified, cached under the store's cache folder) and loads it.
    It resolves no names: the gateway sends each request's version (digest)."""

    def __init__(self, store: BlobStore, base: BaseShapes, max_rank: int) -> None:
        self.store = store
        self.base = base
        self.max_rank = max_rank

    def load(self, digest: str, dtype: torch.dtype = torch.float32) -> LoRAAdapter:
        return load_blob(self.store, digest, self.base, dtype, max_rank=self.max_rank)

    def evict(self, digest: str) -> None:
        """Drop the local copy of a remote blob (the store keeps it)."""
        if isinstance(self.store, CachedBlobStore):
            self.store.evict(digest)


def open_source(url: str, model_dir: Path, cache_dir: Path, max_rank: int,
                s3_endpoint_url: str | None = None) -> BlobAdapterSource:
    store = open_blob_store(BlobStoreConfig(url, cache_dir=cache_dir, s3_endpoint_url=s3_endpoint_url))
    return BlobAdapterSource(store, BaseShapes.from_model_dir(model_dir), max_rank)
