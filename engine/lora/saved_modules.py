"""Adapters' saved modules (PEFT's `modules_to_save` and `trainable_token_indices`), applied
to that adapter's rows of a step only: base rows and other adapters' rows are untouched.

- Embedding: a saved embedding replaces the lookup of its rows; trainable token rows, a
  small sorted table (token id -> row) per adapter, replace the looked-up rows of the ids
  they list (one search of the segment's ids in the table).
- Norms: a saved RMSNorm weight normalizes its rows' residual stream (which the fused
  add-and-norm returns beside its output) again with that weight.
- Logits: the final norm likewise; a saved lm_head computes its rows' logits with its own
  [vocab, hidden] matrix (those rows skip the base head); trainable token rows of the
  lm_head (its own, or a tied embedding's) recompute the logits of the ids they list.

An adapter's tensors are copied to the device when it is loaded into a slot and dropped
when the slot is reused; their bytes count in its device size (`sizing.py`), so the
scheduler pages them like its LoRA weights. Steps with such rows run eagerly: CUDA graphs
capture the base path.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

# The model's RMSNorm: norm(x, weight) (the model binds its eps).
Norm = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
LAYER_NORMS: tuple[str, ...] = ("input_layernorm", "post_attention_layernorm")


@dataclass(frozen=True, eq=False)
class TokenTable:
    ids: torch.Tensor  # int64 [n], ascending
    rows: torch.Tensor  # [n, hidden]

    def lookup(self, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(hit [T] bool, index [T] into the table) of `token_ids`."""
        index = torch.searchsorted(self.ids, token_ids).clamp_(max=self.ids.numel() - 1)
        return self.ids[index] == token_ids, index


@dataclass(frozen=True, eq=False)
class SlotModules:
    """One slot's saved modules on the device; None: the base model's."""

    embed: torch.Tensor | None = None
    embed_rows: TokenTable | None = None
    head: torch.Tensor | None = None
    head_rows: TokenTable | None = None
    final_norm: torch.Tensor | None = None
    norms: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)  # (layer, 0 input / 1 post) -> [hidden]

    @property
    def changes_logits(self) -> bool:
        return self.head is not None or self.head_rows is not None or self.final_norm is not None


def to_device(saved, dtype: torch.dtype, device: torch.device) -> SlotModules | None:
    """`saved`: an adapter's `adapters.peft_saved.SavedModules` (None: it has none)."""
    if saved is None:
        return None

    def move(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(device=device, dtype=dtype)

    def table(rows) -> TokenTable | None:
        if rows is None or rows.ids.numel() == 0:
            return None
        return TokenTable(rows.ids.to(device), move(rows.rows))

    embed_rows = table(saved.embed_rows)
    head_rows = embed_rows if saved.head_rows is saved.embed_rows else table(saved.head_rows)
    norms = {(layer, LAYER_NORMS.index(name)): move(w) for (layer, name), w in saved.norms.items()}
    return SlotModules(move(saved.embed), embed_rows, move(saved.head), head_rows, move(saved.final_norm), norms)


class SavedModuleSlots:
    """Every device slot's saved modules; most slots have none."""

    def __init__(self) -> None:
        self.slots: dict[int, SlotModules] = {}

    def set_slot(self, slot: int, modules: SlotModules | None) -> None:
        if modules is None:
            self.slots.pop(slot, None)
        else:
            self.slots[slot] = modules

    def any_of(self, slots: list[int]) -> bool:
        return bool(self.slots) and any(s in self.slots for s in slots)

    def batch(self, segments: list[tuple[int, int, int]]) -> SavedBatch | None:
        """The step's rows of adapters with saved modules (`packing.segments_of`'s segments);
        None when it has none."""
        mine = [(s, e, self.slots[slot]) for s, e, slot in segments if slot in self.slots]
        return SavedBatch(mine) if mine else None

    def heads(self, row_slots: list[int]) -> HeadRows | None:
        """For the rows whose logits are computed (their slots, in order): those of adapters
        whose saved modules change logits; None when none do."""
        groups: dict[int, list[int]] = {}
        for i, slot in enumerate(row_slots):
            m = self.slots.get(slot)
            if m is not None and m.changes_logits:
                groups.setdefault(slot, []).append(i)
        return HeadRows([(self.slots[s], rows) for s, rows in groups.items()]) if groups else None


class SavedBatch:
    """One step's segments of adapters with saved modules: (start row, end row, modules)."""

    def __init__(self, segments: list[tuple[int, int, SlotModules]]) -> None:
        self.segments = segments
        self.embeds = [(s, e, m) for s, e, m in segments if m.embed is not None or m.embed_rows is not None]

    def embed(self, input_ids: torch.Tensor, x: torch.Tensor) -> None:
        """Replace the embedding rows of these adapters' tokens in place."""
        for start, end, m in self.embeds:
            ids = input_ids[start:end]
            if m.embed is not None:
                x[start:end] = F.embedding(ids, m.embed)
            else:
                hit, index = m.embed_rows.lookup(ids)
                x[start:end] = torch.where(hit[:, None], m.embed_rows.rows[index], x[start:end])

    def norm(self, layer: int, which: int, x: torch.Tensor, h: torch.Tensor, norm: Norm) -> None:
        """h[rows] = norm(x[rows]) with the adapter's weight, for the adapters that saved
        this norm (`which`: 0 the input norm, 1 the post-attention norm)."""
        for start, end, m in self.segments:
            w = m.norms.get((layer, which))
            if w is not None:
                h[start:end] = norm(x[start:end], w)


class HeadRows:
    """Logit rows of adapters whose saved modules change them: (modules, row indices)."""

    def __init__(self, groups: list[tuple[SlotModules, list[int]]]) -> None:
        self.groups = groups

    def logits(self, hidden: torch.Tensor, h: torch.Tensor, base_head, norm: Norm) -> torch.Tensor:
        """fp32 logits of `hidden` [n, hidden] (the residual stream), `h` its base-normed rows,
        `base_head(h rows) -> logits` the base lm_head."""
        own = []  # rows with a saved lm_head: the base head never sees them
        for m, rows in self.groups:
            if m.final_norm is not None:
                idx = torch.tensor(rows, device=h.device)
                h.index_copy_(0, idx, norm(hidden.index_select(0, idx), m.final_norm))
            if m.head is not None:
                own += rows
        if not own:
            logits = base_head(h).float()
        else:
            logits = torch.empty(h.shape[0], self._vocab(), dtype=torch.float32, device=h.device)
            keep = sorted(set(range(h.shape[0])) - set(own))
            if keep:
                idx = torch.tensor(keep, device=h.device)
                logits.index_copy_(0, idx, base_head(h.index_select(0, idx)).float())
        for m, rows in self.groups:
            idx = torch.tensor(rows, device=h.device)
            hr = h.index_select(0, idx)
            if m.head is not None:
                logits.index_copy_(0, idx, F.linear(hr, m.head).float())
            if m.head_rows is not None:
                t = m.head_rows
                logits[idx[:, None], t.ids[None, :]] = F.linear(hr, t.rows).float()
        return logits

    def _vocab(self) -> int:
        return next(m.head.shape[0] for m, _ in self.groups if m.head is not None)
