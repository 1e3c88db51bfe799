"""An adapter's weights in the per-layer, per-group layout every LoRA backend starts from.

Tokens of one step are ordered so each adapter's tokens are contiguous (one segment in
the decode group, one in the prefill group). Per segment and per layer, LoRA runs as a
shrink `x·A` and an expand `(x·A)·B` on the projections that share an input (q/k/v,
o, gate/up, down): the work is per segment, not per token, and base-model rows are
never touched.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

# Projections that read the same input share one shrink.
GROUPS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}


@dataclass
class PackedGroup:
    a: torch.Tensor  # [sum of ranks, in] — every module's A stacked
    # Per module: (output column offset, output width, rank offset, rank, B*scale [out, r]).
    parts: list[tuple[int, int, int, int, torch.Tensor]]
    width: int  # the group's output features, every module's (targeted or not)
    _b_fused: torch.Tensor | None = field(default=None, repr=False)

    @property
    def b_fused(self) -> torch.Tensor:
        """[width, sum of ranks] block-diagonal B*scale, made at first use: only the torch
        backend's per-segment path reads it, so the others never hold (or copy) it."""
        if self._b_fused is None:
            a = self.a
            fused = torch.zeros(self.width, a.shape[0], dtype=a.dtype, device=a.device)
            for c, width, r0, r, b in self.parts:
                fused[c:c + width, r0:r0 + r] = b
            self._b_fused = fused
        return self._b_fused

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor of the adapter's data (A, then each module's B)."""
        return [self.a] + [p[4] for p in self.parts]

    def with_tensors(self, tensors: list[torch.Tensor]) -> PackedGroup:
        """The same group over `tensors` (as `tensors()` lists them, e.g. copied to a device)."""
        parts = [(c, w, r0, r, b) for (c, w, r0, r, _), b in zip(self.parts, tensors[1:], strict=True)]
        return PackedGroup(tensors[0], parts, self.width)


def projection_sizes(arch) -> tuple[dict[str, int], dict[str, int]]:
    """(input width per group, output width per module) of a `ModelArch`."""
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    h, i = arch.hidden_size, arch.intermediate_size
    out_sizes = {"q_proj": q, "k_proj": kv, "v_proj": kv, "o_proj": h, "gate_proj": i, "up_proj": i, "down_proj": h}
    return {"qkv": h, "o": q, "gate_up": h, "down": i}, out_sizes


def pack_adapter(adapter, out_sizes: dict[str, int], num_layers: int, dtype: torch.dtype,
                 device: torch.device) -> list[dict[str, PackedGroup]]:
    """Per layer, per group: the adapter's weights in the layout the LoRA backends copy from."""
    layers: list[dict[str, PackedGroup]] = []
    for layer in range(num_layers):
        groups = {}
        for g, modules in GROUPS.items():
            a_parts, parts, col, roff = [], [], 0, 0
            for m in modules:
                w = adapter.weights.get((layer, m))
                if w is not None:
                    b = (w.b.float() * w.scale).to(dtype=dtype, device=device)
                    a_parts.append(w.a.to(dtype=dtype, device=device))
                    parts.append((col, out_sizes[m], roff, w.rank, b))
                    roff += w.rank
                col += out_sizes[m]
            if parts:
                groups[g] = PackedGroup(torch.cat(a_parts).contiguous(), parts, col)
        layers.append(groups)
    return layers


def segments_of(seqs: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(num tokens, slot) per sequence in batch order -> (start row, end row, slot) for each
    run of rows with the same adapter slot; base-model rows (slot < 0) are left out."""
    segments: list[tuple[int, int, int]] = []
    row = 0
    for n, slot in seqs:
        if slot >= 0:
            if segments and segments[-1][2] == slot and segments[-1][1] == row:
                segments[-1] = (segments[-1][0], row + n, slot)
            else:
                segments.append((row, row + n, slot))
        row += n
    return segments
