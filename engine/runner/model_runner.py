"""Executes a `SchedulerOutput`: builds the ragged batch, runs the model, samples."""
from __future__ import annotations

import itertools
import logging
import math
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from ..checkpoint import ModelArch, load_state_dict
from ..config import CPU_KV_CACHE_MEMORY, EngineConfig
from ..kernels import builds_state_per_shape, create_backend, select_backend
from ..lora.epilogue import CheckpointWeights
from ..models.llama import LlamaModel
from ..request import Request
from ..sampler import Logprobs, Sampler, SampleRow, top_logprobs
from ..sched.step_plan import ScheduledSeq, SchedulerOutput
from .cpu_graphs import CpuDecodeGraphs
from .cpu_tuning import keep_freed_memory_in_heap
from .host_memory import host_memory_available, lazy_zeros, spare_for_weights
from .cuda_graphs import CUDAGraphRunner, DecodeInputs, GraphPolicy, LlamaDecodeForward
from .memory_budget import (DeviceMemory, MemoryPlanConfig, ModelShape, default_adapter_rows, device_memory,
                            kv_bytes_per_block, plan_fixed_kv, plan_on_device)

log = logging.getLogger(__name__)

# Prompt positions whose full-vocabulary logits are held at once (bounds the memory).
_PROMPT_LOGPROB_ROWS = 256

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class StepResult:
    """What a step produced, by request id: the tokens sampled at each sampled position
    (one; with drafts, one per verified position), their logprobs, and the logprobs of
    prompt tokens its chunks predicted (position -> entry)."""

    tokens: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[Logprobs | None]] = field(default_factory=dict)
    prompt_logprobs: dict[str, dict[int, Logprobs]] = field(default_factory=dict)


class ModelRunner:
    """Loads the model on its device, sizes and allocates the KV cache (memory_budget.py),
    captures decode CUDA graphs where they apply (cuda_graphs.py), and runs steps.

    The KV caches and, with CUDA graphs, the LoRA rows are allocated before the graphs
    are captured and never reallocated: the graphs read them by address."""

    def __init__(self, config: EngineConfig, arch: ModelArch, model_dir: str, lora_manager=None) -> None:
        if config.model.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {config.model.dtype!r}; use one of {sorted(DTYPES)}")
        self.config = config
        self.arch = arch
        self.dtype = DTYPES[config.model.dtype]
        self.device = torch.device(config.model.device)
        self.max_model_len = min(config.model.max_model_len or arch.max_position_embeddings,
                                 arch.max_position_embeddings)
        at_start = None
        if self.device.type == "cuda":
            if self.device.index is None:  # torch.cuda's memory and device calls want an index
                self.device = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(self.device)  # Triton launches on the current device
            at_start = device_memory(self.device)  # before anything of ours is on it
        keep_freed_memory_in_heap()
        # One kernel backend for the engine's life: attention, KV writes, layer ops, linears, LoRA.
        self.backend = create_backend(select_backend(config.kernels, self.device, self.dtype), self.device, self.dtype)
        self.block_size = config.cache.block_size
        with torch.device("meta"):
            model = LlamaModel(arch)
        model = model.to(self.dtype).to_empty(device=self.device)  # allocated once, in its dtype
        model.load_weights(load_state_dict(model_dir, self.dtype))
        self.model = model.eval()
        make_linear = self.backend.linear_factory(*self._linear_memory())
        if make_linear is not None:
            self.model.pack_weights(make_linear)
        self.model.set_attention_ops(self.backend.write_kv, self.backend.paged_attention)
        self.model.set_layer_ops(self.backend.layer_ops())
        self.sampler = Sampler(config.seed, self.backend.nucleus, self.backend.plain_draw)
        self.lora = lora_manager
        if lora_manager is not None:  # adapter rows before sizing the KV cache and capturing
            lora_manager.bind(arch, self.dtype, self.device, self.backend.lora_backend,
                              fixed_rows=self._fixed_adapter_rows(at_start),
                              base_weights=CheckpointWeights(model_dir, self.dtype))
        self.num_blocks = self._plan_kv(at_start)
        self.kv_caches = self._allocate_kv(self.num_blocks)
        # Bytes of one block of the pool: KV for block_size tokens, or one adapter page.
        self.block_bytes = kv_bytes_per_block(ModelShape.from_arch(arch), self.block_size, self.dtype.itemsize)
        log.info("KV cache: %d blocks of %d tokens (%.1f MiB) on %s; %s kernels", self.num_blocks, self.block_size,
                 self.num_blocks * self.block_bytes / 2**20, self.device, self.backend.name)
        self.graphs = self._capture_graphs()
        self.cpu_graphs = CpuDecodeGraphs(self.model, self.kv_caches, self.block_size,
                                          -(-self.max_model_len // self.block_size)) \
            if self.backend.name == "cpu" and not config.enforce_eager else None

    def _linear_memory(self) -> tuple[int, int | None]:
        """(bytes of the weights the linear layers are made from, host memory they may take
        beyond those): on a CPU, what the host has once the KV pool is set aside."""
        model = self.model
        head = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
        weights = [m.weight for m in model.layers.modules() if isinstance(m, nn.Linear)] + [head]
        weight_bytes = sum(w.numel() * w.element_size() for w in weights)
        if self.device.type != "cpu":
            return weight_bytes, None
        c = self.config.cache
        per_block = kv_bytes_per_block(ModelShape.from_arch(self.arch), c.block_size, self.dtype.itemsize)
        kv = c.num_blocks * per_block if c.num_blocks is not None else c.kv_cache_memory_bytes or CPU_KV_CACHE_MEMORY
        return weight_bytes, spare_for_weights(kv)

    def _fixed_adapter_rows(self, at_start: DeviceMemory | None) -> int:
        """Rows for a LoRA backend that allocates them once (CUDA graphs read them by
        address) when max_loras does not say: see memory_budget.default_adapter_rows."""
        s = self.config.scheduler
        if at_start is None:
            return s.max_num_seqs
        left = int(at_start.total * self.config.cache.gpu_memory_utilization) - (at_start.free - device_memory(
            self.device).free)
        return default_adapter_rows(ModelShape.from_arch(self.arch), self.config.lora.max_lora_rank,
                                    self.dtype.itemsize, left, s.max_num_seqs)

    def _allocate_kv(self, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Zeroed K and V caches per layer; on a CPU views of one mapping that takes host
        memory as blocks are first written."""
        a, slots = self.arch, num_blocks * self.block_size
        shape = (a.num_kv_heads, slots, a.head_dim)
        if self.device.type != "cpu":
            return [tuple(torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(2))
                    for _ in range(a.num_layers)]
        pool = lazy_zeros(2 * a.num_layers * math.prod(shape), self.dtype).view(a.num_layers, 2, *shape)
        return [(layer[0], layer[1]) for layer in pool]

    # -- the KV cache's size ---------------------------------------------------------
    def memory_plan_config(self) -> MemoryPlanConfig:
        """What sizing reads of the config: the adapter rows allocated up front (a growing
        backend's adapters take pages of the pool instead), and the staging copies."""
        lora = self.lora
        rows = lora.backend.num_slots if lora is not None else 0
        staged = lora.max_staged if lora is not None and lora.stager is not None else 0
        return MemoryPlanConfig.from_engine(self.config, self.max_model_len, self.dtype.itemsize,
                                            adapter_rows=rows, staged_loras=staged)

    def _plan_kv(self, at_start: DeviceMemory | None) -> int:
        """`cache.num_blocks` exactly; else on CUDA what gpu_memory_utilization (or
        kv_cache_memory) leaves, on a CPU kv_cache_memory (1 GiB by default).
        `DeviceMemoryError` when one max_model_len sequence cannot fit."""
        c, shape, cfg = self.config.cache, ModelShape.from_arch(self.arch), self.memory_plan_config()
        if c.num_blocks is not None:
            return c.num_blocks
        if at_start is None:
            return plan_fixed_kv(shape, cfg, c.kv_cache_memory_bytes or CPU_KV_CACHE_MEMORY,
                                 host_memory_available()).num_blocks
        plan = plan_on_device(shape, cfg, self.device, at_start, itertools.chain(self.model.parameters(),
                                                                                 self.model.buffers()),
                              self._profile_forward())
        torch.cuda.empty_cache()  # the profile's dummy KV cache: give its memory back for the real one
        log.info("%s", plan.describe())
        return plan.num_blocks

    def _profile_forward(self):
        """One forward of a max_num_batched_tokens prefill (capped at max_model_len) and the
        logits of max_num_seqs rows: the activation peak the KV cache must leave room for.
        Its dummy KV cache is made here, outside the measured peak."""
        s = self.config.scheduler
        n = min(s.max_num_batched_tokens, self.max_model_len)
        nb = -(-n // self.block_size)
        caches = self._allocate_kv(nb)
        meta = self.backend.build_metadata([(0, n, list(range(nb)))], self.block_size)
        ids = torch.zeros(n, dtype=torch.long, device=self.device)
        positions = torch.arange(n, device=self.device)

        @torch.inference_mode()
        def forward() -> None:
            hidden = self.model(ids, positions, meta, caches)
            self.model.compute_logits(hidden[-min(n, s.max_num_seqs):])
        return forward

    # -- CUDA graphs -------------------------------------------------------------------
    def _capture_graphs(self) -> CUDAGraphRunner | None:
        policy = GraphPolicy.build(self.config.scheduler.max_num_seqs, self.device, self.backend.name,
                                   self.config.enforce_eager)
        if not policy.enabled:
            return None
        start = time.perf_counter()
        lora_weights = self.lora.backend if self.lora is not None else None
        forward = LlamaDecodeForward(self.model, self.kv_caches, self.block_size, lora_weights)
        graphs = CUDAGraphRunner(forward, policy, -(-self.max_model_len // self.block_size), self.device)
        graphs.capture()
        log.info("CUDA graphs for decode widths %s captured in %.1f s (--enforce-eager turns them off)",
                 ",".join(map(str, policy.widths)), time.perf_counter() - start)
        return graphs

    def _replay(self, seqs: list[ScheduledSeq]) -> torch.Tensor | None:
        """The step's hidden states from a CUDA graph or a CPU one, or None when it runs
        eagerly (a prefill chunk in it, wider than the widest graph, no graphs; on a CPU
        also adapter rows)."""
        if self.cpu_graphs is not None:
            if any(len(s.token_ids) != 1 or s.adapter_slot >= 0 for s in seqs):
                return None
            return self.cpu_graphs.run(seqs)
        if self.graphs is None or self._saved_modules_in([s.adapter_slot for s in seqs]):
            return None  # the graphs hold the base embedding, norms and head
        if self.graphs.policy.width_for_step([len(s.token_ids) for s in seqs]) is None:
            return None
        step = DecodeInputs.from_rows([(s.token_ids[0], s.start_pos, s.block_ids, s.adapter_slot) for s in seqs],
                                      self.block_size)
        return self.graphs.run(step)

    @torch.inference_mode()
    def warm_up(self, row_counts: list[int]) -> None:
        """Run every projection and the LM head whose kernel builds state per shape (oneDNN's
        primitives) once per row count, so that it is built now rather than in the first
        steps that meet each shape. Kernels without such state are not run: for them the
        warm-up would cost seconds at every start and spare no step anything."""
        # State is per weight shape: one projection of each shape is enough. modules()
        # yields a layer before its parts, and the layer routes rows as serving does.
        linears: dict[tuple[int, int], nn.Module] = {}
        for m in self.model.modules():
            if hasattr(m, "in_features") and builds_state_per_shape(m):
                linears.setdefault((m.in_features, m.out_features), m)
        head = self.model.packed_head is None and builds_state_per_shape(self.model.lm_head or self.model.embed_tokens)
        for n in row_counts:
            for m in linears.values():
                m(torch.zeros(n, m.in_features, dtype=self.dtype, device=self.device))
            if head:
                self.model.compute_logits(torch.zeros(n, self.arch.hidden_size, dtype=self.dtype, device=self.device))

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, requests: dict[str, Request]) -> StepResult:
        # Decodes first (attention computes them in groups of similar context length),
        # then prefills; within each, ordered by adapter so every adapter's tokens form
        # one segment, and decodes by length so a base-model group is a run of rows.
        # The scheduler's engine loaded the step's adapters before this is called.
        seqs = sorted(out.seqs, key=lambda s: (len(s.token_ids) != 1, s.adapter_slot, s.start_pos))
        # A graph's output is overwritten by the next replay: the logits below are taken
        # from it within this step.
        hidden = self._replay(seqs)
        if hidden is None:
            hidden = self._eager(seqs)
        result = StepResult()
        if any(requests[s.request_id].sampling.prompt_logprobs is not None for s in seqs):
            result.prompt_logprobs = self._prompt_logprobs(seqs, hidden, requests)
        rows, sample_rows, owners, slots, end = [], [], [], [], 0
        for s in seqs:
            end += len(s.token_ids)
            if s.sample:
                req = requests[s.request_id]
                drafts = s.token_ids[len(s.token_ids) - s.num_drafts:]
                # Position i verifies draft i: sampled as if drafts[:i] were output already
                # (the output so far matters only to penalties).
                seen = req.output_token_ids
                for i in range(s.num_drafts + 1):
                    rows.append(end - 1 - s.num_drafts + i)
                    if i and req.sampling.has_penalties:
                        seen = req.output_token_ids + drafts[:i]
                    sample_rows.append(SampleRow(req.sampling, req.num_output_tokens + i, req.prompt_token_ids, seen,
                                                 req.grammar))
                    owners.append(s.request_id)
                    slots.append(s.adapter_slot)
        if not rows:
            return result
        # Unwidened: the sampler widens only the rows it does not draw from them as they are.
        logits = self.model.compute_logits(hidden[rows], self._heads(slots), widen=False)
        tokens, logprobs = self.sampler.sample(logits, sample_rows)
        for rid, tok, lp in zip(owners, tokens, logprobs):
            result.tokens.setdefault(rid, []).append(tok)
            result.logprobs.setdefault(rid, []).append(lp)
        return result

    def _eager(self, seqs: list[ScheduledSeq]) -> torch.Tensor:
        ids, pos = [], []
        for s in seqs:
            ids.extend(s.token_ids)
            pos.extend(range(s.start_pos, s.start_pos + len(s.token_ids)))
        meta = self.backend.build_metadata([(s.start_pos, len(s.token_ids), s.block_ids) for s in seqs],
                                           self.block_size)
        lora = saved = None
        if self.lora is not None:
            rows = [(len(s.token_ids), s.adapter_slot) for s in seqs]
            lora, saved = self.lora.batch(rows), self.lora.saved_batch(rows)
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        positions = torch.tensor(pos, dtype=torch.long, device=self.device)
        return self.model(input_ids, positions, meta, self.kv_caches, lora, saved)

    def _saved_modules_in(self, slots: list[int]) -> bool:
        return self.lora is not None and self.lora.saved.any_of(slots)

    def _heads(self, row_slots: list[int]):
        """The logit rows of adapters with their own final norm or lm_head (saved_modules.py)."""
        return self.lora.saved.heads(row_slots) if self._saved_modules_in(row_slots) else None

    def _prompt_logprobs(self, seqs: list, hidden: torch.Tensor, requests: dict[str, Request]
                         ) -> dict[str, dict[int, Logprobs]]:
        """Logprobs of the prompt tokens this step's chunks predict (row p predicts token
        p + 1), by request and position, for the requests that ask for them."""
        rows, targets, top_n, where, slots = [], [], [], [], []
        found: dict[str, dict[int, Logprobs]] = {}
        end = 0
        for s in seqs:
            req = requests[s.request_id]
            first, end = end, end + len(s.token_ids)
            n = req.sampling.prompt_logprobs
            if n is None or req.num_output_tokens:
                continue  # a recompute after preemption: already reported
            for pos in range(s.start_pos, min(s.start_pos + len(s.token_ids), req.num_prompt_tokens - 1)):
                rows.append(first + pos - s.start_pos)
                slots.append(s.adapter_slot)
                targets.append(req.prompt_token_ids[pos + 1])
                top_n.append(n)
                where.append((req, pos + 1))
        for lo in range(0, len(rows), _PROMPT_LOGPROB_ROWS):
            hi = lo + _PROMPT_LOGPROB_ROWS
            logits = self.model.compute_logits(hidden[rows[lo:hi]], self._heads(slots[lo:hi]))
            for (req, pos), lp in zip(where[lo:hi], top_logprobs(logits, targets[lo:hi], top_n[lo:hi])):
                found.setdefault(req.request_id, {})[pos] = lp
        return found
