"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds, top-n logprobs."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .request import SamplingParams

Logprobs = tuple[float, list[tuple[int, float]]]  # (chosen token's logprob, top-n)

# Below this temperature sampling is greedy (as in vLLM): logits / T overflows float32
# to inf for T below ~1e-37, and softmax then turns the whole row into NaN (which
# sampled token 0). Down here a draw differs from argmax only for near-exact ties.
_MIN_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SampleRow:
    params: SamplingParams
    # Index of the token being sampled within the request's output: with a seed, the
    # noise depends only on (seed, index), so output is reproducible whatever else
    # shares the batch and across preemption.
    output_index: int


def _filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, idx = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (always the top token).
        drop = probs.cumsum(-1) - probs >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(0, idx, sorted_logits)
    return logits


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    def _noise(self, vocab: int, row: SampleRow) -> torch.Tensor:
        if row.params.seed is None:
            return torch.empty(vocab).exponential_(generator=self.generator)
        g = torch.Generator().manual_seed((row.params.seed * 1_000_003 + row.output_index) & 0x7FFF_FFFF_FFFF_FFFF)
        return torch.empty(vocab).exponential_(generator=g)

    def sample(self, logits: torch.Tensor, rows: list[SampleRow]) -> tuple[list[int], list[Logprobs | None]]:
        """logits: [N, vocab] float32, one row per request to sample."""
        tokens = logits.argmax(dim=-1)
        for i, row in enumerate(rows):
            p = row.params
            if p.greedy or not p.temperature >= _MIN_TEMPERATURE:  # (NaN is greedy too)
                continue
            lg = _filter_top_k_top_p(logits[i] / p.temperature, p.top_k, p.top_p)
            probs = torch.softmax(lg, dim=-1)
            # Exponential race (Gumbel-max equivalent): argmax(p / E) samples from p.
            # The noise is drawn on the CPU (the generators are CPU generators, so a seeded
            # request draws the same on every device) and moved to the logits' device.
            tokens[i] = torch.argmax(probs / self._noise(probs.shape[0], row).to(probs.device))
        out_tokens = tokens.tolist()
        logprobs: list[Logprobs | None] = [None] * len(rows)
        want = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        if want:
            lp = torch.log_softmax(logits[want], dim=-1)
            for j, i in enumerate(want):
                n = rows[i].params.logprobs
                top = torch.topk(lp[j], n) if n else None
                chosen = float(lp[j, out_tokens[i]])
                logprobs[i] = (chosen, list(zip(top.indices.tolist(), top.values.tolist())) if top else [])
        return out_tokens, logprobs
