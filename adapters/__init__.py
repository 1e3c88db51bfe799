"""loraplex adapters: PEFT LoRA parsing and validation, content digests, the disk store and the
shared blob store."""
from __future__ import annotations

from .blobs import BlobStore, BlobStoreConfig, load_blob, open_blob_store
from .digest import adapter_digest
from .errors import (
    AdapterArchiveError,
    AdapterCorruptedError,
    AdapterError,
    AdapterNotFoundError,
    AdapterPatternTimeoutError,
    AdapterTooLargeError,
    AdapterValidationError,
    BlobStoreError,
    InvalidAdapterNameError,
)
from .limits import max_adapter_bytes
from .peft import LoRAAdapter, LoRAWeight, load_peft_adapter
from .shapes import LORA_MODULES, BaseShapes
from .store import AdapterRecord, AdapterStore

__all__ = [
    "LORA_MODULES",
    "AdapterArchiveError",
    "AdapterCorruptedError",
    "AdapterError",
    "AdapterNotFoundError",
    "AdapterPatternTimeoutError",
    "AdapterRecord",
    "AdapterStore",
    "AdapterTooLargeError",
    "AdapterValidationError",
    "BaseShapes",
    "BlobStore",
    "BlobStoreConfig",
    "BlobStoreError",
    "InvalidAdapterNameError",
    "LoRAAdapter",
    "LoRAWeight",
    "adapter_digest",
    "load_blob",
    "load_peft_adapter",
    "max_adapter_bytes",
    "open_blob_store",
]
