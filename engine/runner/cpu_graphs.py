"""Replayed decode steps on a CPU: the layers' C kernel calls recorded once per batch
width and made again, without the Python around them.

A decode step of a small model on the "cpu" backend is ~300 C kernel calls (projections,
norms, RoPE, KV writes, attention), each reached through a module call, a launcher's
checks, output allocations and ctypes argument conversion. As CUDA graphs do on a GPU
(cuda_graphs.py), a width's first steps run the layers eagerly while `build.run` records
each kernel call with its arguments (raw pointers), and later steps of that width copy
their inputs into the same buffers and make the recorded calls again. SmolLM2's 30 layers
at batch 64 on 2 cores of an AMX Xeon, in one process: 51 ms replayed against 63 ms
eager (more than the ~2.5 ms the Python itself costs: the same buffers every step, and
the kernels' OpenMP regions back to back).

What makes that valid, checked while recording (a width whose recording fails the check
runs eagerly for good, the recording step's own results being eager ones):
- inside the layers every torch call allocates, takes a view (one that did not copy) or
  reads a tensor's shape, strides or address: any that computes would be skipped by a
  replay;
- every tensor made while recording is kept, so the recorded pointers stay its buffers;
- the layers read the step only through buffers owned here (token embeddings, RoPE
  tables, KV slots, context lengths and block tables at their widest), filled in place;
- weights and the KV caches keep their storage for the runner's life.
Recorded only for widths met on two steps in a row (a recording step pays for the
checks), and at most `MAX_WIDTHS` widths are kept (least recently used out): ~0.5 MiB of
activations per row of width for a 30-layer model of SmolLM2-135M's shape.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode

from ..kernels.cpu import build
from ..kernels.cpu.metadata import CpuAttentionMetadata
from ..sched.step_plan import ScheduledSeq
from .cuda_graphs import DecodeInputs

MAX_WIDTHS = 4
# What the layers may do in torch while recording: allocate, take views, read a tensor's
# shape, strides and address. A view op that had to copy (a reshape of a strided tensor,
# indexing by a tensor) is refused as computing.
_ALLOCATE = frozenset({torch.empty, torch.empty_like})
_VIEW = frozenset({torch.Tensor.view, torch.Tensor.reshape, torch.Tensor.__getitem__})
_READ = frozenset({torch.Tensor.data_ptr, torch.Tensor.stride, torch.Tensor.is_contiguous, torch.Tensor.dim,
                   torch.Tensor.numel, torch.Tensor.size, torch.Tensor.element_size})


class _Recorder(TorchFunctionMode):
    """Keeps every tensor the recorded layers make; notes any torch call that computes.
    (A function mode, not a dispatch mode: the latter imports torch._dynamo, a second at
    every process start.)"""

    def __init__(self) -> None:
        super().__init__()
        self.kept: list[torch.Tensor] = []
        self.refused: str | None = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _ALLOCATE:
            self.kept.append(out)
        elif func in _VIEW:
            if not _shares(out, args[0]):
                self.refused = self.refused or f"{func.__name__} (a copy)"
            self.kept.append(out)
        elif func not in _READ and not _is_property(func):
            self.refused = self.refused or getattr(func, "__name__", str(func))
        return out


def _is_property(func) -> bool:
    """A tensor property's getter (shape, dtype, device...)."""
    return type(func).__name__ == "method-wrapper" or getattr(func, "__name__", "") == "__get__"


def _shares(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


@dataclass
class _Graph:
    """One width's recorded calls, the buffers they read, and what they leave the result in."""

    calls: list[tuple]
    batch: DecodeInputs  # the step's tokens, positions and attention metadata, staged in place
    x: torch.Tensor  # [W, hidden]: the step's token embeddings (the first layer's residual, in place)
    cos: torch.Tensor
    sin: torch.Tensor
    meta: CpuAttentionMetadata
    out: tuple[torch.Tensor, torch.Tensor]  # (residual, last MLP output): hidden = their sum
    kept: list[torch.Tensor] = field(default_factory=list)


class CpuDecodeGraphs:
    """Records and replays pure decode steps of `model` (a `LlamaModel` on the "cpu"
    backend) over `kv_caches`; `max_blocks`: blocks of the longest context."""

    def __init__(self, model, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_size: int, max_blocks: int,
                 max_widths: int = MAX_WIDTHS) -> None:
        self.model, self.kv_caches, self.block_size, self.max_blocks = model, kv_caches, block_size, max_blocks
        self.max_widths = max_widths
        self.graphs: OrderedDict[int, _Graph] = OrderedDict()
        self.eager_only: set[int] = set()
        self.last_width = 0
        self.replays = 0

    def run(self, seqs: list[ScheduledSeq]) -> torch.Tensor | None:
        """Hidden states [W, hidden] of a pure-decode step of base-model rows (recorded or
        replayed), or None where it runs eagerly as usual."""
        width, previous = len(seqs), self.last_width
        self.last_width = width
        if width in self.eager_only:
            return None
        graph = self.graphs.get(width)
        if graph is None:
            return self._record(seqs) if width == previous else None
        self.graphs.move_to_end(width)
        self._stage(graph, seqs)
        for fn, args, items in graph.calls:
            build.run(fn, args, items)
        self.replays += 1
        return graph.out[0] + graph.out[1]

    def _record(self, seqs: list[ScheduledSeq]) -> torch.Tensor:
        width, m = len(seqs), self.model
        batch = DecodeInputs.allocate(width, self.max_blocks, "cpu")
        batch.stage(_decode_inputs(seqs, self.block_size), width)
        meta = CpuAttentionMetadata(slot_mapping=batch.slot_mapping, block_size=self.block_size, num_decodes=width,
                                    seq_lens=batch.context_lens, block_tables=batch.block_tables)
        x = m.embed_tokens(batch.input_ids)
        cos, sin = m.rope(batch.positions, x.dtype)
        graph = _Graph([], batch, x, cos, sin, meta, (x, x))
        recorder = _Recorder()
        with build.recording(graph.calls), recorder:
            graph.out = m.run_layers(x, cos, sin, meta, self.kv_caches)
        hidden = graph.out[0] + graph.out[1]
        if recorder.refused is not None:
            self.eager_only.add(width)  # (this step's results are eager ones all the same)
            return hidden
        graph.kept = recorder.kept
        self.graphs[width] = graph
        while len(self.graphs) > self.max_widths:
            self.graphs.popitem(last=False)
        return hidden

    def _stage(self, graph: _Graph, seqs: list[ScheduledSeq]) -> None:
        """The step's tokens, positions, KV slots, context lengths and block tables into the
        buffers the calls read (block-table columns past a table keep older block ids, which
        the kernel never reads: it reads within each context length)."""
        batch = graph.batch
        batch.stage(_decode_inputs(seqs, self.block_size), batch.width)
        torch.index_select(self.model.embed_tokens.weight, 0, batch.input_ids, out=graph.x)
        cos, sin = self.model.rope(batch.positions, graph.x.dtype)
        graph.cos.copy_(cos)
        graph.sin.copy_(sin)


def _decode_inputs(seqs: list[ScheduledSeq], block_size: int) -> DecodeInputs:
    return DecodeInputs.from_rows([(s.token_ids[0], s.start_pos, s.block_ids, -1) for s in seqs], block_size)
