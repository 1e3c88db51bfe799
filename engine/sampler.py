"""Token sampling: logits processors (grammar masks, logit_bias, penalties), then greedy,
temperature, min-p, top-k, top-p, per-request seeds, top-n logprobs.

Each processor runs only on the rows that ask for it, batched over those rows; a batch
where no row asks for one pays nothing for it, and the other rows' logits stay untouched.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from .request import SamplingParams

Logprobs = tuple[float, list[tuple[int, float]]]  # (chosen token's logprob, top-n)

# Below this temperature sampling is greedy (as in vLLM): logits / T overflows float32
# to inf for T below ~1e-37, and softmax then turns the whole row into NaN (which
# sampled token 0). Down here a draw differs from argmax only for near-exact ties.
_MIN_TEMPERATURE = 1e-5


class TokenConstraint(Protocol):
    """A per-request grammar: which tokens may come next, and the token that did."""

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into bitmask[row] (int32, one bit per token id)."""

    def accept(self, token: int) -> None:
        """Advance past the token sampled for this request."""


@dataclass(frozen=True)
class SampleRow:
    params: SamplingParams
    # Index of the token being sampled within the request's output: with a seed, the
    # noise depends only on (seed, index), so output is reproducible whatever else
    # shares the batch and across preemption.
    output_index: int
    # The request's tokens so far (read only when the params carry penalties).
    prompt_token_ids: Sequence[int] = ()
    output_token_ids: Sequence[int] = ()
    grammar: TokenConstraint | None = None


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


def _filter_min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    # vLLM: drop tokens whose probability is below min_p times the top token's.
    probs = torch.softmax(logits, dim=-1)
    return logits.masked_fill(probs < min_p * probs.max(), float("-inf"))


def _padded(seqs: list[Sequence[int]], pad: int, device: torch.device) -> torch.Tensor:
    width = max(1, max(map(len, seqs)))
    out = torch.full((len(seqs), width), pad, dtype=torch.long)
    for i, s in enumerate(seqs):
        if s:
            out[i, :len(s)] = torch.as_tensor(s, dtype=torch.long)
    return out.to(device)


def _bin_counts(token_ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """[rows, vocab] occurrence counts; the pad id `vocab` lands in a dropped extra column."""
    counts = torch.zeros(token_ids.shape[0], vocab + 1, dtype=torch.long, device=token_ids.device)
    counts.scatter_add_(1, token_ids, torch.ones_like(token_ids))
    return counts[:, :vocab]


def apply_penalties(logits: torch.Tensor, prompt_ids: torch.Tensor, output_ids: torch.Tensor,
                    presence: torch.Tensor, frequency: torch.Tensor, repetition: torch.Tensor) -> torch.Tensor:
    """vLLM's `apply_penalties` on [rows, vocab] logits; token id tensors padded with `vocab`.

    Repetition divides positive / multiplies negative logits of tokens seen in the prompt
    or the output; frequency subtracts per occurrence in the output, presence once."""
    vocab = logits.shape[-1]
    output_counts = _bin_counts(output_ids, vocab)
    output_mask = output_counts > 0
    seen = (_bin_counts(prompt_ids, vocab) > 0) | output_mask
    rep = torch.where(seen, repetition[:, None], torch.ones_like(logits))
    logits = torch.where(logits > 0, logits / rep, logits * rep)
    logits = logits - frequency[:, None] * output_counts
    return logits - presence[:, None] * output_mask


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    def _noise(self, vocab: int, row: SampleRow) -> torch.Tensor:
        if row.params.seed is None:
            return torch.empty(vocab).exponential_(generator=self.generator)
        g = torch.Generator().manual_seed((row.params.seed * 1_000_003 + row.output_index) & 0x7FFF_FFFF_FFFF_FFFF)
        return torch.empty(vocab).exponential_(generator=g)

    def sample(self, logits: torch.Tensor, rows: list[SampleRow]) -> tuple[list[int], list[Logprobs | None]]:
        """logits: [N, vocab] float32, one row per request to sample. Logprobs are of the
        raw logits (vLLM's default); the token is drawn from the processed ones."""
        raw = logits
        # The processed logits can overwrite the raw ones unless a row wants their logprobs.
        logits = self.process(logits, rows, copy=any(r.params.logprobs is not None for r in rows))
        tokens = logits.argmax(dim=-1)
        for i, row in enumerate(rows):
            p = row.params
            if p.greedy or not p.temperature >= _MIN_TEMPERATURE:  # (NaN is greedy too)
                continue
            lg = logits[i] / p.temperature
            if p.min_p > 0:
                lg = _filter_min_p(lg, p.min_p)
            lg = _filter_top_k_top_p(lg, p.top_k, p.top_p)
            probs = torch.softmax(lg, dim=-1)
            # Exponential race (Gumbel-max equivalent): argmax(p / E) samples from p.
            # The noise is drawn on the CPU (the generators are CPU generators, so a seeded
            # request draws the same on every device) and moved to the logits' device.
            tokens[i] = torch.argmax(probs / self._noise(probs.shape[0], row).to(probs.device))
        out_tokens = tokens.tolist()
        for row, token in zip(rows, out_tokens):
            if row.grammar is not None:
                row.grammar.accept(token)
        return out_tokens, self._logprobs(raw, rows, out_tokens)

    def process(self, logits: torch.Tensor, rows: list[SampleRow], copy: bool = True) -> torch.Tensor:
        """Grammar masks, logit_bias and penalties (vLLM's order), on the rows that carry
        them; returns `logits` itself when no row does, else the processed logits (a copy,
        or `logits` changed in place when `copy` is False)."""
        masked = [i for i, r in enumerate(rows) if r.grammar is not None]
        biased = [i for i, r in enumerate(rows) if r.params.logit_bias]
        penalized = [i for i, r in enumerate(rows) if r.params.has_penalties]
        if not (masked or biased or penalized):
            return logits
        if copy:
            logits = logits.clone()
        if masked:
            self._apply_grammars(logits, rows, masked)
        if biased:
            r_idx, t_idx, vals = [], [], []
            for i in biased:
                for tok, bias in rows[i].params.logit_bias:
                    r_idx.append(i)
                    t_idx.append(tok)
                    vals.append(bias)
            index = (torch.tensor(r_idx, device=logits.device), torch.tensor(t_idx, device=logits.device))
            logits.index_put_(index, torch.tensor(vals, dtype=logits.dtype, device=logits.device), accumulate=True)
        if penalized:
            sel = [rows[i] for i in penalized]
            vocab, dev = logits.shape[-1], logits.device
            idx = torch.tensor(penalized, device=dev)
            params = [[r.params.presence_penalty, r.params.frequency_penalty, r.params.repetition_penalty]
                      for r in sel]
            pres, freq, rep = torch.tensor(params, dtype=logits.dtype, device=dev).unbind(1)
            logits[idx] = apply_penalties(logits[idx], _padded([r.prompt_token_ids for r in sel], vocab, dev),
                                          _padded([r.output_token_ids for r in sel], vocab, dev), pres, freq, rep)
        return logits

    @staticmethod
    def _apply_grammars(logits: torch.Tensor, rows: list[SampleRow], masked: list[int]) -> None:
        import xgrammar as xgr  # only engines that serve constrained requests load it

        bitmask = xgr.allocate_token_bitmask(len(rows), logits.shape[-1])
        for i in masked:
            rows[i].grammar.fill_bitmask(bitmask, i)
        xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=masked)

    @staticmethod
    def _logprobs(logits: torch.Tensor, rows: list[SampleRow], tokens: list[int]) -> list[Logprobs | None]:
        logprobs: list[Logprobs | None] = [None] * len(rows)
        want = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        if want:
            found = top_logprobs(logits[want], [tokens[i] for i in want], [rows[i].params.logprobs for i in want])
            for i, lp in zip(want, found):
                logprobs[i] = lp
        return logprobs


def top_logprobs(logits: torch.Tensor, chosen: list[int], top_n: list[int]) -> list[Logprobs]:
    """Per row of raw [rows, vocab] logits: the chosen token's logprob and the top-n."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    picked = lp.gather(1, torch.tensor(chosen, device=lp.device)[:, None])[:, 0].tolist()
    width = max(top_n)
    top = torch.topk(lp, width) if width else None
    ids, vals = (top.indices.tolist(), top.values.tolist()) if top is not None else ([], [])
    return [(picked[j], list(zip(ids[j][:n], vals[j][:n])) if n else []) for j, n in enumerate(top_n)]
