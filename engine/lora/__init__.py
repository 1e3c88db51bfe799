"""Multi-LoRA: the manager (adapter tiers), weight packing, and the LoRA backends."""
from .backend import LoRABackend, LoRAHook
from .manager import LoRAManager
from .packing import GROUPS, PackedGroup, pack_adapter, segments_of

__all__ = ["GROUPS", "LoRABackend", "LoRAHook", "LoRAManager", "PackedGroup", "pack_adapter", "segments_of"]
