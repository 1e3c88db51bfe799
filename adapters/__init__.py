"""loraplex adapters: PEFT LoRA parsing and validation, content digests, the disk store."""
from __future__ import annotations

from .digest import adapter_digest
from .errors import AdapterError, AdapterNotFoundError, AdapterValidationError, InvalidAdapterNameError
from .peft import LoRAAdapter, LoRAWeight, load_peft_adapter
from .shapes import LORA_MODULES, BaseShapes
from .store import AdapterRecord, AdapterStore

__all__ = [
    "LORA_MODULES",
    "AdapterError",
    "AdapterNotFoundError",
    "AdapterRecord",
    "AdapterStore",
    "AdapterValidationError",
    "BaseShapes",
    "InvalidAdapterNameError",
    "LoRAAdapter",
    "LoRAWeight",
    "adapter_digest",
    "load_peft_adapter",
]
