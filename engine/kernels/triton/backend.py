"""The "triton" backend: Triton kernels for attention, the KV write and multi-LoRA
(on CUDA; on a CPU through Triton's interpreter, for tests)."""
from __future__ import annotations

from ..torch.attention import RaggedAttentionMetadata, build_ragged_metadata
from ..torch.backend import TorchBackend
from .kv_write import triton_write_kv
from .lora import StackedLoRAWeights
from .paged_attention import triton_paged_attention


class TritonBackend(TorchBackend):
    """Triton's attention, KV write and LoRA; the torch layer ops and linears."""

    name = "triton"
    lora_backend = StackedLoRAWeights
    write_kv = staticmethod(triton_write_kv)
    paged_attention = staticmethod(triton_paged_attention)

    def build_metadata(self, seqs: list[tuple[int, int, list[int]]], block_size: int) -> RaggedAttentionMetadata:
        return build_ragged_metadata(seqs, block_size, self.dtype, self.device)
