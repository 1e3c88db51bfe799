"""The attention metadata the C kernels read."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..torch.attention import TorchAttentionMetadata, build_metadata, ragged_tables


@dataclass
class CpuAttentionMetadata(TorchAttentionMetadata):
    """The torch form (prefill chunks: the C prefill kernel's work items come from them,
    and SDPA runs them where the kernel does not take a shape) plus what the decode
    kernel reads: each sequence's context length after this step and block table."""

    seq_lens: torch.Tensor | None = None  # [B] int32
    block_tables: torch.Tensor | None = None  # [B, max blocks] int32, padded with 0
    work_items: torch.Tensor | None = None  # prefill.prefill_items, made on first use


def build_cpu_metadata(seqs: list[tuple[int, int, list[int]]], block_size: int, dtype: torch.dtype,
                       device: torch.device | str = "cpu") -> CpuAttentionMetadata:
    """`seqs`: (start_pos, num_new_tokens, block_ids) in batch order, decodes first."""
    _, seq_lens, tables = ragged_tables(seqs, device)
    return build_metadata(seqs, block_size, dtype, device, CpuAttentionMetadata, seq_lens=seq_lens,
                          block_tables=tables)
