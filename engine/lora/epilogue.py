"""Per-output-feature epilogues: DoRA's rescale and lora_bias's bias, batched per step.

PEFT's `DoraLinearLayer` (eval mode, peft 0.21) turns a target module's output into

    y = base + (f - 1) * (base - bias_base) + f * lora * scale,   f = m / ||W + scale * B @ A||_row

with m the adapter's magnitude vector, W and bias_base the base module's weight and bias.
That is `y = f * (base + lora * scale) + (1 - f) * bias_base`; with lora_bias=true
(`lora_B` carries a bias b) plain LoRA adds `b * scale`. Both are one affine map per
output feature after the expand step:

    out[rows] = out[rows] * scale_f + shift_f

where scale_f and shift_f are fixed per adapter, layer and module: computed once when
the adapter enters the CPU tier (`module_epilogues`, fp32, from the base weights as
served), kept with its packed weights, and stacked per device slot (`EpilogueStacks`).
The C and Triton expand kernels apply the map as they write a row's deltas; on the torch
path `EpilogueBatch` applies it to a step's rows of those adapters after the deltas.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from ..checkpoint import read_tensors
from .packing import GROUPS, PackedGroup

# (layer, module) -> (W [out, in], base bias [out] or None), in the dtype the engine serves.
BaseWeights = Callable[[int, str], tuple[torch.Tensor, torch.Tensor | None]]
# (layer, module) -> (scale [out] or None, shift [out] or None), fp32.
Epilogues = dict[tuple[int, str], tuple[torch.Tensor | None, torch.Tensor | None]]
# Segments up to this many rows share one gathered op; longer ones run per segment.
GATHER_MAX_ROWS = 16


class AdapterLoadError(ValueError):
    """An adapter whose epilogue cannot be computed for this engine (DoRA without the
    base weights, or a DoRA norm of zero)."""


class CheckpointWeights:
    """`BaseWeights` read from the model's safetensors folder, one module at a time and
    cast to the served dtype: the engine's own copies may be packed into a kernel's
    layout (kernels/torch/linear.py, kernels/cpu/gemm.py) and fused (q/k/v, gate/up)."""

    def __init__(self, model_dir: str | Path, dtype: torch.dtype) -> None:
        self.model_dir, self.dtype = Path(model_dir), dtype

    def __call__(self, layer: int, module: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        parent = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
        name = f"model.layers.{layer}.{parent}.{module}"
        found = read_tensors(self.model_dir, [f"{name}.weight", f"{name}.bias"], self.dtype)
        if f"{name}.weight" not in found:
            raise AdapterLoadError(f"the base checkpoint has no {name}.weight")
        return found[f"{name}.weight"], found.get(f"{name}.bias")


@torch.no_grad()
def module_epilogues(adapter, base_weights: BaseWeights | None) -> Epilogues:
    """The epilogue of every module of `adapter` that has one (DoRA or lora_bias), as PEFT
    computes it, in fp32. DoRA reads each targeted module's base weight once, here."""
    out: Epilogues = {}
    for (layer, module), w in sorted(adapter.weights.items()):
        magnitude, bias = getattr(w, "magnitude", None), getattr(w, "bias", None)
        if magnitude is None and bias is None:
            continue
        shift = None if bias is None else bias.float() * w.scale
        scale = None
        if magnitude is not None:
            if base_weights is None:
                raise AdapterLoadError("DoRA adapters need the base model's weights; this engine has none")
            weight, base_bias = base_weights(layer, module)
            delta = w.b.float() @ w.a.float()
            norm = torch.linalg.norm(weight.float() + w.scale * delta, dim=1)
            scale = magnitude.float() / norm
            if not bool(torch.isfinite(scale).all()):
                raise AdapterLoadError(f"DoRA rescale of layer {layer} {module} is not finite (a zero column norm)")
            if shift is not None:
                shift = shift * scale
            if base_bias is not None:
                shift = (1 - scale) * base_bias.float() + (0 if shift is None else shift)
        out[(layer, module)] = (scale, shift)
    return out


def apply_epilogue(o: torch.Tensor, scale: torch.Tensor | None, shift: torch.Tensor | None) -> None:
    """o = o * scale + shift in place, computed in fp32 (a bf16 DoRA factor would lose
    most of its 1 - f)."""
    f = o if o.dtype == torch.float32 else o.float()
    if scale is not None:
        f.mul_(scale)
    if shift is not None:
        f.add_(shift)
    if f is not o:
        o.copy_(f)


class EpilogueStacks:
    """Every device slot's epilogue per group: scale and shift [layers, slots, width] fp32
    (identity for modules and slots without one), and which (layer, slot) have one.

    `eager`: allocate at once (CUDA graphs read them by address), else at the first
    adapter with an epilogue, so engines serving plain LoRA hold none."""

    def __init__(self, num_slots: int, num_layers: int, widths: dict[str, int], device: torch.device,
                 eager: bool = False) -> None:
        self.num_slots, self.num_layers, self.widths, self.device = num_slots, num_layers, widths, device
        self.scale: dict[str, torch.Tensor] = {}
        self.shift: dict[str, torch.Tensor] = {}
        self.flags_t: dict[str, torch.Tensor] = {}  # int32 [layers, slots], 1: has an epilogue
        self.flags = {g: [[False] * num_slots for _ in range(num_layers)] for g in GROUPS}  # host copy
        self.slots: set[int] = set()  # slots with an epilogue in any layer and group
        if eager:
            self._allocate()

    def _allocate(self) -> None:
        """New (identity) stacks for every slot; the previous dicts are left to the caller."""
        shapes = {g: (self.num_layers, self.num_slots, w) for g, w in self.widths.items()}
        self.scale = {g: torch.ones(s, dtype=torch.float32, device=self.device) for g, s in shapes.items()}
        self.shift = {g: torch.zeros(s, dtype=torch.float32, device=self.device) for g, s in shapes.items()}
        self.flags_t = {g: torch.zeros(s[:2], dtype=torch.int32, device=self.device) for g, s in shapes.items()}
        # Per group and layer (flags [slots], scale and shift [slots, width]): the kernels'
        # argument, as views made once, not per call.
        self._layers = {g: [(self.flags_t[g][i], self.scale[g][i], self.shift[g][i]) for i in range(self.num_layers)]
                        for g in shapes}

    def layer(self, group: str, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(flags int32 [slots], scale fp32 [slots, width], shift fp32 [slots, width]) of one
        layer and group: what the C and Triton kernels take (allocated stacks only)."""
        return self._layers[group][layer]

    def ensure_rows(self, n: int) -> None:
        """At least `n` slots, keeping every slot's epilogue."""
        if n <= self.num_slots:
            return
        old, self.num_slots = self.num_slots, n
        for per_layer in (x for g in GROUPS for x in self.flags[g]):
            per_layer.extend([False] * (n - old))
        if self.scale:
            kept = self.scale, self.shift, self.flags_t
            self._allocate()
            for new, before in zip((self.scale, self.shift, self.flags_t), kept):
                for g in new:
                    new[g][:, :old] = before[g]

    @torch.no_grad()
    def set_slot(self, slot: int, packed: list[dict[str, PackedGroup]]) -> None:
        """Take `slot`'s epilogues from `packed` (identity where it has none)."""
        self.ensure_rows(slot + 1)
        has = any(p.scale is not None or p.shift is not None for layer in packed for p in layer.values())
        if has and not self.scale:
            self._allocate()
        self.slots.discard(slot)
        for g in GROUPS:
            if self.scale:
                self.scale[g][:, slot] = 1
                self.shift[g][:, slot] = 0
            for layer, groups in enumerate(packed):
                p = groups.get(g)
                on = p is not None and (p.scale is not None or p.shift is not None)
                self.flags[g][layer][slot] = on
                if on:
                    self.slots.add(slot)
                    if p.scale is not None:
                        self.scale[g][layer, slot] = p.scale
                    if p.shift is not None:
                        self.shift[g][layer, slot] = p.shift
            if self.scale:
                self.flags_t[g][:, slot] = torch.tensor([self.flags[g][i][slot] for i in range(self.num_layers)],
                                                        dtype=torch.int32)


class EpilogueBatch:
    """One step's rows of adapters with an epilogue; `apply` runs after the LoRA deltas
    are in `out`. Short segments share one gather per layer and group (decode steps with
    many DoRA adapters stay a few ops), long ones are rescaled in place per segment."""

    def __init__(self, stacks: EpilogueStacks, segments: list[tuple[int, int, int]]) -> None:
        self.stacks = stacks
        mine = [s for s in segments if s[2] in stacks.slots]
        self.long = [s for s in mine if s[1] - s[0] > GATHER_MAX_ROWS]
        short = [s for s in mine if s[1] - s[0] <= GATHER_MAX_ROWS]
        self.short_slots = sorted({slot for _, _, slot in short})
        self.rows = self.row_slots = None
        if short:
            dev = stacks.device
            self.rows = torch.tensor([r for s, e, _ in short for r in range(s, e)], device=dev)
            self.row_slots = torch.tensor([slot for s, e, slot in short for _ in range(s, e)], device=dev)

    @staticmethod
    def of(stacks: EpilogueStacks, segments: list[tuple[int, int, int]]) -> EpilogueBatch | None:
        """The step's epilogue batch, None when no segment's adapter has an epilogue."""
        return EpilogueBatch(stacks, segments) if any(s[2] in stacks.slots for s in segments) else None

    def apply(self, layer: int, group: str, out: torch.Tensor) -> None:
        st = self.stacks
        flags = st.flags[group][layer]
        for start, end, slot in self.long:
            if flags[slot]:
                apply_epilogue(out[start:end], st.scale[group][layer, slot], st.shift[group][layer, slot])
        if self.rows is not None and any(flags[s] for s in self.short_slots):
            # Identity rows of slots without one here add 0 and scale by 1: exact.
            rows = out.index_select(0, self.rows)
            apply_epilogue(rows, st.scale[group][layer].index_select(0, self.row_slots),
                           st.shift[group][layer].index_select(0, self.row_slots))
            out.index_copy_(0, self.rows, rows)
