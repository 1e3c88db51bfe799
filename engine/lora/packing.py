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
    # The epilogue (epilogue.py: DoRA, lora_bias) over the group's width, fp32, identity
    # (1, 0) on modules without one; None when no module has that part.
    scale: torch.Tensor | None = None
    shift: torch.Tensor | None = None
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
        """Every tensor of the adapter's data (A, each module's B, then scale and shift if any)."""
        return [self.a] + [p[4] for p in self.parts] + [t for t in (self.scale, self.shift) if t is not None]

    def with_tensors(self, tensors: list[torch.Tensor]) -> PackedGroup:
        """The same group over `tensors` (as `tensors()` lists them, e.g. copied to a device)."""
        n = 1 + len(self.parts)
        parts = [(c, w, r0, r, b) for (c, w, r0, r, _), b in zip(self.parts, tensors[1:n], strict=True)]
        rest = iter(tensors[n:])
        scale = None if self.scale is None else next(rest)
        shift = None if self.shift is None else next(rest)
        return PackedGroup(tensors[0], parts, self.width, scale, shift)


def projection_sizes(arch) -> tuple[dict[str, int], dict[str, int]]:
    """(input width per group, output width per module) of a `ModelArch`."""
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    h, i = arch.hidden_size, arch.intermediate_size
    out_sizes = {"q_proj": q, "k_proj": kv, "v_proj": kv, "o_proj": h, "gate_proj": i, "up_proj": i, "down_proj": h}
    return {"qkv": h, "o": q, "gate_up": h, "down": i}, out_sizes


def pack_adapter(adapter, out_sizes: dict[str, int], num_layers: int, dtype: torch.dtype,
                 device: torch.device, epilogues: dict | None = None) -> list[dict[str, PackedGroup]]:
    """Per layer, per group: the adapter's weights in the layout the LoRA backends copy from.
    `epilogues`: `epilogue.module_epilogues(adapter, ...)`, required when it has any."""
    epilogues = epilogues or {}
    layers: list[dict[str, PackedGroup]] = []
    for layer in range(num_layers):
        groups = {}
        for g, modules in GROUPS.items():
            a_parts, parts, col, roff, epi = [], [], 0, 0, []
            for m in modules:
                w = adapter.weights.get((layer, m))
                if w is not None:
                    b = (w.b.float() * w.scale).to(dtype=dtype, device=device)
                    a_parts.append(w.a.to(dtype=dtype, device=device))
                    parts.append((col, out_sizes[m], roff, w.rank, b))
                    roff += w.rank
                    if (layer, m) in epilogues:
                        epi.append((col, out_sizes[m], *epilogues[(layer, m)]))
                    elif getattr(w, "magnitude", None) is not None or getattr(w, "bias", None) is not None:
                        raise ValueError(f"layer {layer} {m} needs its epilogue (epilogue.module_epilogues)")
                col += out_sizes[m]
            if parts:
                scale, shift = _group_epilogue(epi, col, device)
                groups[g] = PackedGroup(torch.cat(a_parts).contiguous(), parts, col, scale, shift)
        layers.append(groups)
    return layers


def _group_epilogue(parts: list, width: int, device: torch.device):
    """(scale, shift) over a group's width from its modules' (col, width, scale, shift)."""
    scale = shift = None
    for col, w, sc, sh in parts:
        if sc is not None:
            scale = torch.ones(width, dtype=torch.float32) if scale is None else scale
            scale[col:col + w] = sc
        if sh is not None:
            shift = torch.zeros(width, dtype=torch.float32) if shift is None else shift
            shift[col:col + w] = sh
    return tuple(None if t is None else t.to(device) for t in (scale, shift))


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
