"""Executes a `SchedulerOutput`: builds the ragged batch, runs the model, samples."""
from __future__ import annotations

import logging

import torch

from .config import EngineConfig
from .cpu_tuning import keep_freed_memory_in_heap
from .kernels import create_backend, select_backend
from .loader import ModelArch, load_state_dict
from .models.llama import LlamaModel
from .request import Request
from .sampler import Logprobs, Sampler, SampleRow, top_logprobs
from .scheduler import SchedulerOutput

log = logging.getLogger(__name__)

# Prompt positions whose full-vocabulary logits are held at once (bounds the memory).
_PROMPT_LOGPROB_ROWS = 256

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def kv_bytes_per_block(arch: ModelArch, block_size: int, dtype: torch.dtype) -> int:
    return 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * block_size * dtype.itemsize


class ModelRunner:
    def __init__(self, config: EngineConfig, arch: ModelArch, model_dir: str, lora_manager=None) -> None:
        if config.model.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {config.model.dtype!r}; use one of {sorted(DTYPES)}")
        self.config = config
        self.arch = arch
        self.dtype = DTYPES[config.model.dtype]
        self.device = torch.device(config.model.device)
        keep_freed_memory_in_heap()
        # One kernel backend for the engine's life: attention, KV writes, layer ops, linears, LoRA.
        self.backend = create_backend(select_backend(config.kernels, self.device, self.dtype), self.device, self.dtype)
        self.block_size = config.cache.block_size
        with torch.device("meta"):
            model = LlamaModel(arch)
        model = model.to_empty(device=self.device).to(self.dtype)
        model.load_weights(load_state_dict(model_dir, self.dtype))
        self.model = model.eval()
        make_linear = self.backend.linear_factory()
        if make_linear is not None:
            self.model.pack_weights(make_linear)
        self.model.set_attention_ops(self.backend.write_kv, self.backend.paged_attention)
        self.model.set_layer_ops(self.backend.layer_ops())
        self.num_blocks = self._num_blocks()
        slots = self.num_blocks * self.block_size
        self.kv_caches = [
            (torch.zeros(arch.num_kv_heads, slots, arch.head_dim, dtype=self.dtype, device=self.device),
             torch.zeros(arch.num_kv_heads, slots, arch.head_dim, dtype=self.dtype, device=self.device))
            for _ in range(arch.num_layers)
        ]
        self.sampler = Sampler(config.seed)
        self.lora = lora_manager
        if lora_manager is not None:
            lora_manager.bind(arch, self.dtype, self.device, self.backend.lora_backend)
        log.info("KV cache: %d blocks of %d tokens (%.1f MiB); %s kernels", self.num_blocks, self.block_size,
                 self.num_blocks * kv_bytes_per_block(arch, self.block_size, self.dtype) / 2**20, self.backend.name)

    @torch.inference_mode()
    def warm_up(self, row_counts: list[int]) -> None:
        """Run every projection and the LM head once per row count, so oneDNN creates its
        per-shape primitives now rather than in the first steps that meet each shape."""
        # Primitives are per shape: one projection of each weight shape is enough.
        linears = {(m.in_features, m.out_features): m for m in self.model.modules() if hasattr(m, "in_features")}
        head = self.model.packed_head
        for n in row_counts:
            for m in linears.values():
                m(torch.zeros(n, m.in_features, dtype=self.dtype, device=self.device))
            if head is None:
                self.model.compute_logits(torch.zeros(n, self.arch.hidden_size, dtype=self.dtype, device=self.device))

    def _num_blocks(self) -> int:
        c = self.config.cache
        if c.num_blocks is not None:
            return c.num_blocks
        per_block = kv_bytes_per_block(self.arch, c.block_size, self.dtype)
        n = c.kv_cache_memory_bytes // per_block
        if n < 1:
            raise ValueError(f"kv_cache_memory_bytes={c.kv_cache_memory_bytes} holds no block ({per_block} bytes each)")
        return int(n)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, requests: dict[str, Request]
                ) -> tuple[dict[str, int], dict[str, Logprobs | None]]:
        # Decodes first (attention computes them in groups of similar context length),
        # then prefills; within each, ordered by adapter so every adapter's tokens form
        # one segment, and decodes by length so a base-model group is a run of rows.
        seqs = sorted(out.seqs, key=lambda s: (len(s.token_ids) != 1, s.adapter_slot, s.start_pos))
        ids, pos = [], []
        for s in seqs:
            ids.extend(s.token_ids)
            pos.extend(range(s.start_pos, s.start_pos + len(s.token_ids)))
        meta = self.backend.build_metadata([(s.start_pos, len(s.token_ids), s.block_ids) for s in seqs],
                                           self.block_size)
        lora = None
        if self.lora is not None:
            self.lora.load(out.adapter_loads)
            lora = self.lora.batch([(len(s.token_ids), s.adapter_slot) for s in seqs])
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        positions = torch.tensor(pos, dtype=torch.long, device=self.device)
        hidden = self.model(input_ids, positions, meta, self.kv_caches, lora)
        if any(requests[s.request_id].sampling.prompt_logprobs is not None for s in seqs):
            self._prompt_logprobs(seqs, hidden, requests)
        rows, sample_seqs, end = [], [], 0
        for s in seqs:
            end += len(s.token_ids)
            if s.sample:
                rows.append(end - 1)
                sample_seqs.append(s)
        if not rows:
            return {}, {}
        logits = self.model.compute_logits(hidden[rows])
        reqs = [requests[s.request_id] for s in sample_seqs]
        sample_rows = [SampleRow(r.sampling, r.num_output_tokens, r.prompt_token_ids, r.output_token_ids, r.grammar)
                       for r in reqs]
        tokens, logprobs = self.sampler.sample(logits, sample_rows)
        ids_ = [s.request_id for s in sample_seqs]
        return dict(zip(ids_, tokens)), dict(zip(ids_, logprobs))

    def _prompt_logprobs(self, seqs: list, hidden: torch.Tensor, requests: dict[str, Request]) -> None:
        """Logprobs of the prompt tokens this step's chunks predict (row p predicts token
        p + 1), stored on the requests that ask for them."""
        rows, targets, top_n, where = [], [], [], []
        end = 0
        for s in seqs:
            req = requests[s.request_id]
            first, end = end, end + len(s.token_ids)
            n = req.sampling.prompt_logprobs
            if n is None or req.num_output_tokens:
                continue  # a recompute after preemption: already reported
            for pos in range(s.start_pos, min(s.start_pos + len(s.token_ids), req.num_prompt_tokens - 1)):
                rows.append(first + pos - s.start_pos)
                targets.append(req.prompt_token_ids[pos + 1])
                top_n.append(n)
                where.append((req, pos + 1))
        for lo in range(0, len(rows), _PROMPT_LOGPROB_ROWS):
            hi = lo + _PROMPT_LOGPROB_ROWS
            logits = self.model.compute_logits(hidden[rows[lo:hi]])
            for (req, pos), lp in zip(where[lo:hi], top_logprobs(logits, targets[lo:hi], top_n[lo:hi])):
                req.prompt_logprobs[pos] = lp
