"""The torch backend: engine/attention.py's paged attention and KV write, the torch
layer ops and LoRA, oneDNN-packed linears where the CPU runs bf16/fp16 natively.
The reference of the other backends, and what runs where neither can."""
from __future__ import annotations

from .. import attention
from ..lora.torch_backend import TorchLoRABackend
from .backend import KernelBackend


class TorchBackend(KernelBackend):
    name = "torch"
    lora_backend = TorchLoRABackend
    write_kv = staticmethod(attention.write_kv)
    paged_attention = staticmethod(attention.paged_attention)

    def build_metadata(self, seqs: list[tuple[int, int, list[int]]], block_size: int
                       ) -> attention.TorchAttentionMetadata:
        return attention.build_metadata(seqs, block_size, self.dtype, self.device)
