"""A `serve` replica's adapters when several replicas share a registry and an adapter store.

Each replica keeps its own disk store (<data_dir>/adapters: the versions uploaded through
it), so that store cannot say which version a name means now: another replica may have
published or replaced it. The registry (the shared database) says, and the shared store
holds every version the registry names (`add_adapter(..., blobs=...)` publishes it there
before the registry row commits).
"""
from __future__ import annotations

import torch

from loraplex.adapters import AdapterNotFoundError, AdapterStore, LoRAAdapter
from loraplex.adapters.sources import BlobAdapterSource

from loraplex.platform.tenancy.adapter_directory import AdapterDirectory, RegistryVersion


class RegistryAdapterSource:
    """The LoRA manager's `NamedAdapterSource` for one replica of several.

    `get(name)` is the registry's current version of `name` (UnknownAdapterError when it
    has none; a database error when the database is unreachable). `load(digest)` reads
    this replica's disk store when it holds the version, else fetches it from the shared
    store (verified, cached); AdapterNotFoundError when neither has it, BlobStoreError
    when the shared store is unreachable.
    """

    def __init__(self, directory: AdapterDirectory, local: AdapterStore, shared: BlobAdapterSource) -> None:
        self.directory = directory
        self.local = local
        self.shared = shared

    def get(self, name: str) -> RegistryVersion:
        return self.directory.version(name)

    def load(self, digest: str, dtype: torch.dtype = torch.float32) -> LoRAAdapter:
        try:
            return self.local.load(digest, dtype)
        except AdapterNotFoundError:
            return self.shared.load(digest, dtype)
