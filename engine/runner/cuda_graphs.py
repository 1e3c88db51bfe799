"""CUDA graphs for decode steps.

A decode step of a small model is mostly launch overhead: hundreds of kernels of a few
microseconds each. Captured once per batch width and replayed, the step costs one launch.
As in vLLM and nano-vllm:

- `capture_widths` picks the widths at start (1, 2, 4, then every multiple of 8 up to
  max_num_seqs, and max_num_seqs itself); `GraphPolicy.width_for` pads a pure-decode step
  to the next captured width and sends everything else (a prefill chunk in the step, a
  width above the largest captured, `enforce_eager`, a CPU device) to the eager path.
- `CUDAGraphRunner` owns static input buffers at the largest width. A graph reads views
  of them, so a replay is: copy the step's inputs in, fill the padding rows with inert
  values, replay, read the first rows of the static output.

Padding rows are inert: slot -1 (the KV write skips them), context length 1 reading
block-table row entries that are always valid block ids, position 0, adapter slot -1
(an empty LoRA tile). Their outputs are never read.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, fields
from typing import Protocol

import torch

from ..kernels.torch.attention import RaggedAttentionMetadata

# Widths above this run eagerly: a step that wide is compute bound, and each width
# costs capture time and graph memory. vLLM's default cap is the same.
MAX_GRAPH_WIDTH = 512


def capture_widths(max_num_seqs: int, max_width: int = MAX_GRAPH_WIDTH) -> list[int]:
    """1, 2, 4, 8, 16, 24, ... up to min(max_num_seqs, max_width), which is always included."""
    cap = min(max_num_seqs, max_width)
    widths = [w for w in (1, 2, 4) if w <= cap] + list(range(8, cap + 1, 8))
    if cap >= 1 and widths[-1] != cap:
        widths.append(cap)
    return widths


@dataclass(frozen=True)
class GraphPolicy:
    """Which width a step replays at, chosen once at start."""

    widths: tuple[int, ...]  # ascending; empty: every step eager

    @classmethod
    def build(cls, max_num_seqs: int, device: torch.device | str, kernels: str, enforce_eager: bool = False,
              max_width: int = MAX_GRAPH_WIDTH) -> GraphPolicy:
        """Graphs only on CUDA with the Triton kernels: the torch attention path groups
        decodes on the host from Python lists, which a graph cannot replay."""
        if enforce_eager or torch.device(device).type != "cuda" or kernels != "triton":
            return cls(())
        return cls(tuple(capture_widths(max_num_seqs, max_width)))

    @property
    def enabled(self) -> bool:
        return bool(self.widths)

    def width_for(self, num_tokens: int, num_seqs: int) -> int | None:
        """The captured width a step of `num_seqs` sequences and `num_tokens` tokens pads
        to, or None to run it eagerly (a prefill chunk in the step, or too wide)."""
        if not self.widths or num_seqs < 1 or num_tokens != num_seqs or num_seqs > self.widths[-1]:
            return None
        return self.widths[bisect.bisect_left(self.widths, num_seqs)]

    def width_for_step(self, token_counts: list[int]) -> int | None:
        """`width_for` a scheduled step: the tokens each of its sequences computes."""
        return self.width_for(sum(token_counts), len(token_counts))


@dataclass
class DecodeInputs:
    """One decode batch in static buffers: row i is sequence i's single new token."""

    input_ids: torch.Tensor  # [W] int64
    positions: torch.Tensor  # [W] int64
    slot_mapping: torch.Tensor  # [W] int64: the KV slot of the new token, -1 = do not store
    context_lens: torch.Tensor  # [W] int32: tokens in context after this step (new token included)
    block_tables: torch.Tensor  # [W, max blocks per sequence] int32
    adapter_slots: torch.Tensor  # [W] int32: device LoRA slot, -1 = base model
    query_start_loc: torch.Tensor  # [W + 1] int32: 0, 1, ..., W (one query row per sequence)

    @classmethod
    def allocate(cls, width: int, max_blocks_per_seq: int, device: torch.device | str) -> DecodeInputs:
        z = dict(device=device)
        return cls(torch.zeros(width, dtype=torch.long, **z), torch.zeros(width, dtype=torch.long, **z),
                   torch.full((width,), -1, dtype=torch.long, **z), torch.ones(width, dtype=torch.int32, **z),
                   torch.zeros(width, max_blocks_per_seq, dtype=torch.int32, **z),
                   torch.full((width,), -1, dtype=torch.int32, **z),
                   torch.arange(width + 1, dtype=torch.int32, **z))

    @classmethod
    def from_rows(cls, rows: list[tuple[int, int, list[int], int]], block_size: int) -> DecodeInputs:
        """A decode step's host tensors: (token id, position, block table, adapter slot) per
        sequence; each table cut to the blocks its context covers."""
        n = len(rows)
        tables = [b[:pos // block_size + 1] for _, pos, b, _ in rows]
        width = max(map(len, tables))
        # One tensor from padded lists: a tensor per row cost ~0.2 ms a step at 64 rows.
        block_tables = torch.tensor([[*b, *[0] * (width - len(b))] for b in tables], dtype=torch.int32)
        positions = torch.tensor([pos for _, pos, _, _ in rows], dtype=torch.long)
        last_block = block_tables[torch.arange(n), positions // block_size].long()
        return cls(torch.tensor([t for t, _, _, _ in rows], dtype=torch.long), positions,
                   last_block * block_size + positions % block_size, (positions + 1).to(torch.int32), block_tables,
                   torch.tensor([slot for _, _, _, slot in rows], dtype=torch.int32),
                   torch.arange(n + 1, dtype=torch.int32))

    @property
    def width(self) -> int:
        return self.input_ids.shape[0]

    def view(self, width: int) -> DecodeInputs:
        """The first `width` rows: what the graph of that width reads."""
        return DecodeInputs(**{f.name: getattr(self, f.name)[:width + (f.name == "query_start_loc")]
                               for f in fields(self)})

    def stage(self, step: DecodeInputs, width: int) -> None:
        """Copy `step` (n <= width rows, block tables of any width up to ours) into the
        first rows and make rows n..width inert."""
        n, cols = step.width, step.block_tables.shape[1]
        assert n <= width <= self.width and cols <= self.block_tables.shape[1], (n, width, cols)
        for name in ("input_ids", "positions", "slot_mapping", "context_lens", "adapter_slots"):
            getattr(self, name)[:n].copy_(getattr(step, name), non_blocking=True)
        # Columns past `cols` keep older block ids: every entry ever written is a valid
        # block id, and the kernel reads only the blocks within each context length.
        self.block_tables[:n, :cols].copy_(step.block_tables, non_blocking=True)
        if n < width:
            self.input_ids[n:width].zero_()
            self.positions[n:width].zero_()
            self.slot_mapping[n:width].fill_(-1)
            self.context_lens[n:width].fill_(1)
            self.adapter_slots[n:width].fill_(-1)


class DecodeForward(Protocol):
    """The model forward over one decode batch, which the runner provides for capture.

    Contract, so that a captured graph replays the same work on new buffer contents:
    - reads the batch only through the `DecodeInputs` tensors, on the device: no
      `.item()`, `.tolist()`, `.cpu()`, host tensors copied in, or Python branches on
      their values (launch shapes depend on the width alone);
    - allocates only through torch's caching allocator (the graph's private pool);
    - returns the final hidden states [W, hidden_size] (the runner computes logits
      eagerly on the rows it samples); the graph keeps this tensor as its output;
    - the KV caches, weights and LoRA slot stacks it reads keep their storage for the
      runner's life: adapter loads write into the slot tensors in place.
    """

    def __call__(self, batch: DecodeInputs) -> torch.Tensor: ...


class StaticLoRAHook:
    """`LoRAHook` over `kernels.triton.lora.StackedLoRAWeights` with launch shapes fixed by
    the width: one LoRA row tile per batch row (an empty tile for a base-model row) and
    the slot stacks' full rank, so neither depends on which adapters a step uses."""

    BLOCK_M = 16

    def __init__(self, weights, adapter_slots: torch.Tensor) -> None:
        self.weights = weights
        rows = torch.arange(adapter_slots.shape[0], dtype=torch.int32, device=adapter_slots.device)
        used = (adapter_slots >= 0).to(torch.int32)
        self.tiles = torch.stack((rows, rows + used, adapter_slots.clamp(min=0)), dim=1).contiguous()

    def apply(self, layer: int, group: str, x: torch.Tensor, out: torch.Tensor) -> None:
        from ..kernels.triton.lora import lora_expand, lora_shrink

        w = self.weights
        s = lora_shrink(x, w.a[group][layer], w.ranks[group][layer], self.tiles, self.BLOCK_M, w.max_rank)
        # The epilogue (DoRA, lora_bias) always: whether a row's adapter has one is read on the device.
        lora_expand(s, w.b[group][layer], w.ranks[group][layer], self.tiles, w.col_tiles[group], out,
                    self.BLOCK_M, w.BLOCK_N, w.epilogue(group, layer))


class LlamaDecodeForward:
    """`DecodeForward` for `models.llama.LlamaModel` running the Triton attention kernels."""

    def __init__(self, model, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_size: int,
                 lora_weights=None) -> None:
        self.model, self.kv_caches, self.block_size, self.lora_weights = model, kv_caches, block_size, lora_weights

    def __call__(self, batch: DecodeInputs) -> torch.Tensor:
        meta = RaggedAttentionMetadata(slot_mapping=batch.slot_mapping, block_size=self.block_size,
                                 num_decodes=batch.width, query_start_loc=batch.query_start_loc,
                                 seq_lens=batch.context_lens, block_tables=batch.block_tables)
        lora = None if self.lora_weights is None else StaticLoRAHook(self.lora_weights, batch.adapter_slots)
        return self.model(batch.input_ids, batch.positions, meta, self.kv_caches, lora)


class CUDAGraphRunner:
    """Captures `forward` at every width of `policy` and replays decode steps through it.

    Capture after the KV caches and LoRA slot stacks are allocated (graphs bake in their
    addresses) and after a first eager step has set up lazily made state (RoPE
    frequencies). Each width runs once eagerly before its capture, which compiles its
    Triton kernels outside the capture.
    """

    def __init__(self, forward: DecodeForward, policy: GraphPolicy, max_blocks_per_seq: int,
                 device: torch.device | str) -> None:
        self.forward, self.policy = forward, policy
        self.device = torch.device(device)
        self.buffers = DecodeInputs.allocate(max(policy.widths, default=0), max_blocks_per_seq, self.device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    @torch.inference_mode()
    def capture(self) -> None:
        assert self.device.type == "cuda" and self.policy.enabled, (self.device, self.policy)
        pool = None
        # Widest first: the narrower graphs then fit in the memory pool the widest made.
        for width in reversed(self.policy.widths):
            batch = self.buffers.view(width)
            self.forward(batch)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self.forward(batch)
            pool = graph.pool() if pool is None else pool
            self.graphs[width] = (graph, out)
        torch.cuda.synchronize(self.device)

    def run(self, step: DecodeInputs) -> torch.Tensor | None:
        """Hidden states [n, hidden] of a pure-decode step, or None when the step must run
        eagerly. The result is a view of the graph's output: read it before the next run."""
        width = self.policy.width_for(step.width, step.width)
        if width is None or width not in self.graphs:
            return None
        self.buffers.stage(step, width)
        graph, out = self.graphs[width]
        graph.replay()
        return out[:step.width]
