"""Token sampling: logits processors (grammar masks, logit_bias, penalties), then greedy,
temperature, min-p, top-k, top-p, per-request seeds, top-n logprobs.

The whole batch is sampled in a few tensor operations: greedy rows by one argmax, the
others by one pass over their probabilities and noise for one block of tokens per row
(for all rows at once); rows with top-k or top-p go through a partial sort where the
kernel backend has no threshold kernel for them (the "cpu" backend's nucleus.c takes
min-p, top-k and top-p without one). Each processor runs only on the rows that ask for
it; a batch where no row asks for one pays nothing for it.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from .request import SamplingParams

Logprobs = tuple[float, list[tuple[int, float]]]  # (chosen token's logprob, top-n)

# Below this temperature sampling is greedy (as in vLLM): logits / T overflows float32
# to inf for T below ~1e-37, and softmax then turns the whole row into NaN (which
# sampled token 0). Down here a draw differs from argmax only for near-exact ties.
_MIN_TEMPERATURE = 1e-5
# A draw sums the vocabulary in blocks of this many tokens, picks a block, and makes
# noise only for that block's tokens: one sum pass instead of noise for every token.
_BLOCK = 256
# A top-p row without top-k looks for its nucleus among this many top tokens first and
# sorts its whole vocabulary only when they hold less than top_p of the mass.
_TOP_P_CANDIDATES = 256
_M64 = (1 << 64) - 1
_M32 = (1 << 32) - 1


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
    # draw depends only on (seed, index) and the row's logits, so output is reproducible
    # whatever else shares the batch and across preemption.
    output_index: int
    # The request's tokens so far (read only when the params carry penalties).
    prompt_token_ids: Sequence[int] = ()
    output_token_ids: Sequence[int] = ()
    grammar: TokenConstraint | None = None


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def row_key(seed: int, index: int) -> tuple[float, int]:
    """A seeded row's randomness as a pure function of (seed, output index): the uniform
    that picks its block and the 32-bit key of its per-token noise. Counter-based, so no
    generator state is carried between steps or shared between requests."""
    h = _splitmix64(_splitmix64(seed & _M64) ^ (index & _M64))
    return (h >> 11) * 2.0 ** -53, h & _M32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash on int64 tensors holding values below 2**32 (no product
    reaches 2**63, so nothing overflows)."""
    x = ((x >> 16) ^ x) * 0x45D9F3B & _M32
    x = ((x >> 16) ^ x) * 0x45D9F3B & _M32
    return (x >> 16) ^ x


def _is_drawn(p: SamplingParams) -> bool:
    return not (p.greedy or not p.temperature >= _MIN_TEMPERATURE)  # (NaN is greedy too)


def draw(weights: torch.Tensor, u: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """One token per row of non-negative [rows, vocab] weights (each row with some
    positive weight), drawn with probability weight / row total; a weight of 0 is never
    drawn. u (float64, [0, 1)) picks a block of the vocabulary by its share of the row's
    total; within the block, an exponential race on noise keyed by (key, token id).

    Only the block choice is an inverse CDF: rounding-level changes in the logits (another
    batch shape) move a seeded draw only when u lies that close to a block boundary,
    whereas a CDF over single tokens would move it wherever tokens are small."""
    rows, n = weights.shape
    w = weights.contiguous()
    sums = w.as_strided((rows, n // _BLOCK, _BLOCK), (n, _BLOCK, 1)).sum(-1)
    if n % _BLOCK:
        sums = torch.cat([sums, w[:, n - n % _BLOCK:].sum(-1, keepdim=True)], 1)
    cum = sums.double().cumsum(-1)
    total = cum[:, -1:]
    # Strictly below the total, so some block's cumulative weight exceeds it.
    x = torch.minimum(u[:, None].to(cum.device) * total, torch.nextafter(total, torch.zeros_like(total)))
    block = torch.searchsorted(cum, x, right=True).clamp_(max=cum.shape[1] - 1)
    cols = block * _BLOCK + torch.arange(_BLOCK, device=w.device)
    inside = w.gather(1, cols.clamp(max=n - 1)) * (cols < n)
    # Exponential race: argmax(w / E) with E ~ Exp(1) draws in proportion to w.
    h = _mix32(keys[:, None].to(cols.device) ^ _mix32(cols))
    noise = -torch.log((h.double() + 0.5) * 2.0 ** -32)
    return (block * _BLOCK + (inside.double() / noise).argmax(-1, keepdim=True))[:, 0]


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """argmax of each row (the first of tied maxima, as argmax). Through max: torch's CPU
    argmax over [64, 49152] fp32 took 2.3 ms on 2 threads, max 0.9 ms, ~2% of a decode step."""
    return logits.max(dim=-1).indices


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


def _column(values: list[float], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=like.dtype, device=like.device)[:, None]


# nucleus(weights [rows, vocab] fp32 >= 0, each row's largest 1; min_p [rows] fp32, top_k
# [rows] int32, top_p [rows] fp32) -> tau [rows]: min-p's floor, top-k's k-th largest
# weight, then the largest value whose weights >= it hold top_p of what those kept; the
# weights below it are set to 0 in place (kernels/cpu/nucleus.py).
Nucleus = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _draw(logits: torch.Tensor, params: list[SamplingParams], u: torch.Tensor, keys: torch.Tensor,
          nucleus: Nucleus | None = None) -> torch.Tensor:
    """Temperature, min-p, then top-k / top-p, and one draw per row of [rows, vocab]."""
    vocab = logits.shape[-1]
    # Shifted so each row's top logit is 0: exp() below cannot overflow, and min-p
    # (p < min_p * p_max) becomes a threshold on the log-ratio.
    scaled = logits - logits.amax(-1, keepdim=True)
    if any(p.temperature != 1.0 for p in params):
        scaled.div_(_column([p.temperature for p in params], scaled))
    if nucleus is not None:
        return _draw_thresholds(scaled, params, u, keys, nucleus)
    if any(p.min_p > 0 for p in params):
        floor = _column([math.log(p.min_p) if p.min_p > 0 else -math.inf for p in params], scaled)
        scaled.masked_fill_(scaled < floor, -math.inf)
    filtered = [j for j, p in enumerate(params) if 0 < p.top_k < vocab or p.top_p < 1]
    if not filtered:
        return draw(scaled.exp_(), u, keys)
    tokens = torch.empty(len(params), dtype=torch.long, device=logits.device)
    plain = sorted(set(range(len(params))) - set(filtered))
    if plain:
        tokens[plain] = draw(scaled[plain].exp_(), u[plain], keys[plain])
    tokens[filtered] = _draw_top_k_top_p(scaled[filtered], [params[j] for j in filtered], u[filtered], keys[filtered])
    return tokens


def _draw_thresholds(scaled: torch.Tensor, params: list[SamplingParams], u: torch.Tensor, keys: torch.Tensor,
                     nucleus: Nucleus) -> torch.Tensor:
    """`_draw` through the kernel backend's `nucleus`: each row with min-p, top-k or
    top-p keeps the weights at or above its thresholds (each rule's boundary token with
    any token tied with it; a sort would order equals arbitrarily), without a sort."""
    vocab = scaled.shape[-1]
    weights = scaled.exp_()  # each row's largest is 1: min-p's floor is min_p itself
    filtered = [j for j, p in enumerate(params) if p.min_p > 0 or 0 < p.top_k < vocab or p.top_p < 1]
    if filtered:
        rows = weights if len(filtered) == len(params) else weights[filtered]
        nucleus(rows, torch.tensor([params[j].min_p for j in filtered], dtype=torch.float32),
                torch.tensor([params[j].top_k if 0 < params[j].top_k < vocab else 0 for j in filtered],
                             dtype=torch.int32),
                torch.tensor([params[j].top_p for j in filtered], dtype=torch.float32))
        if rows is not weights:
            weights[filtered] = rows
    return draw(weights, u, keys)


def _draw_top_k_top_p(scaled: torch.Tensor, params: list[SamplingParams], u: torch.Tensor, keys: torch.Tensor,
                      width: int | None = None) -> torch.Tensor:
    """Draws among each row's top_k tokens, then the smallest prefix of them (by
    probability) whose renormalized mass reaches top_p. Rows' top tokens come from one
    partial sort of `width` columns; a top-p row whose nucleus is wider is redone whole."""
    vocab = scaled.shape[-1]
    ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    width = width or min(vocab, max(k or _TOP_P_CANDIDATES for k in ks))
    vals, idx = scaled.topk(width)
    weights = vals.exp()
    weights[torch.arange(width, device=vals.device) >= _column([k or width for k in ks], vals)] = 0
    redo: list[int] = []
    if any(p.top_p < 1 for p in params):
        # The mass top-p renormalizes by: the top-k tokens', or the whole row's.
        mass = weights.sum(-1)
        whole = [j for j, k in enumerate(ks) if not k and width < vocab]
        if whole:
            mass[whole] = scaled[whole].exp().sum(-1)
        probs = weights / mass[:, None]
        cum = probs.cumsum(-1)
        top_p = _column([p.top_p for p in params], vals)
        weights[cum - probs >= top_p] = 0
        redo = [j for j in whole if float(cum[j, -1]) < params[j].top_p]
    # Drawn in vocabulary order, not in the sort's: a tiny change in the logits (another
    # batch shape's rounding) may swap near-equal tokens' ranks, and must not move the draw.
    tokens = draw(torch.zeros_like(scaled).scatter_(1, idx, weights), u, keys)
    if redo:
        tokens[redo] = _draw_top_k_top_p(scaled[redo], [params[j] for j in redo], u[redo], keys[redo], vocab)
    return tokens


# plain_draw(logits [rows, vocab] raw, temperature [rows] fp32 (0: greedy), u [rows] float64,
# keys [rows] int64) -> tokens [rows] int64: greedy_tokens, and `draw` on softmax(logits / T)
# by (u, key) (kernels/cpu/draw.py).
PlainDraw = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def is_plain(row: SampleRow, vocab: int) -> bool:
    """A row drawn from its raw logits by temperature alone: no processor, no filter, no
    logprobs."""
    p = row.params
    return (row.grammar is None and not p.logit_bias and not p.has_penalties and p.logprobs is None
            and not p.min_p > 0 and not 0 < p.top_k < vocab and not p.top_p < 1)


class Sampler:
    def __init__(self, seed: int = 0, nucleus: Nucleus | None = None, plain_draw: PlainDraw | None = None) -> None:
        """`nucleus`: the kernel backend's min-p / top-k / top-p thresholds
        (`KernelBackend.nucleus`), or None to filter rows by torch masks and sorts.
        `plain_draw`: the backend's draw for rows that `is_plain` (`KernelBackend.plain_draw`),
        or None to draw them by torch too."""
        self.generator = torch.Generator().manual_seed(seed)
        self.nucleus = nucleus
        self.plain_draw = plain_draw
        # logit_bias as (token ids, values) tensors, per SamplingParams of the last step's
        # rows: a request pays for building them once, not every step.
        self._bias: dict[int, tuple[SamplingParams, torch.Tensor, torch.Tensor]] = {}

    def _noise(self, rows: list[SampleRow]) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's block uniform and noise key: seeded rows' from (seed, output index),
        the others' from the sampler's generator, all rows in one call."""
        u = torch.rand(len(rows), generator=self.generator, dtype=torch.float64)
        keys = torch.randint(0, _M32 + 1, (len(rows),), generator=self.generator)
        seeded = [j for j, r in enumerate(rows) if r.params.seed is not None]
        if seeded:
            drawn = [row_key(rows[j].params.seed, rows[j].output_index) for j in seeded]
            u[seeded] = torch.tensor([d[0] for d in drawn], dtype=torch.float64)
            keys[seeded] = torch.tensor([d[1] for d in drawn])
        return u, keys

    def sample(self, logits: torch.Tensor, rows: list[SampleRow]) -> tuple[list[int], list[Logprobs | None]]:
        """logits: [N, vocab] raw logits (float32, or the model's dtype: widened here for the
        rows that are not plain), one row per request to sample. Logprobs are of the raw
        logits (vLLM's default); the token is drawn from the processed ones."""
        vocab = logits.shape[-1]
        plain = [i for i, r in enumerate(rows) if is_plain(r, vocab)] if self.plain_draw is not None else []
        if len(plain) == len(rows):
            self._bias = {}  # (process's cache of the last step's biased rows: none here)
            return self._draw_plain(logits, rows).tolist(), [None] * len(rows)
        if not plain:
            tokens = self._sample(logits.float(), rows)
        else:
            tokens = torch.empty(len(rows), dtype=torch.long, device=logits.device)
            rest = sorted(set(range(len(rows))) - set(plain))
            tokens[plain] = self._draw_plain(logits[plain], [rows[i] for i in plain])
            tokens[rest] = self._sample(logits[rest].float(), [rows[i] for i in rest])
        out_tokens = tokens.tolist()
        for row, token in zip(rows, out_tokens):
            if row.grammar is not None:
                row.grammar.accept(token)
        return out_tokens, self._logprobs(logits, rows, out_tokens)

    def _draw_plain(self, logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        temperature = torch.zeros(len(rows), dtype=torch.float32)
        u = torch.zeros(len(rows), dtype=torch.float64)
        keys = torch.zeros(len(rows), dtype=torch.int64)
        drawn = [j for j, r in enumerate(rows) if _is_drawn(r.params)]
        if drawn:
            u[drawn], keys[drawn] = self._noise([rows[j] for j in drawn])
            temperature[drawn] = torch.tensor([rows[j].params.temperature for j in drawn], dtype=torch.float32)
        return self.plain_draw(logits if logits.stride(-1) == 1 else logits.contiguous(), temperature, u, keys)

    def _sample(self, logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        """Tokens for fp32 logits by torch (and the backend's nucleus thresholds)."""
        # The processed logits can overwrite the raw ones unless a row wants their logprobs.
        logits = self.process(logits, rows, copy=any(r.params.logprobs is not None for r in rows))
        drawn = [i for i, r in enumerate(rows) if _is_drawn(r.params)]
        if not drawn:
            return greedy_tokens(logits)
        noise = self._noise([rows[i] for i in drawn])
        params = [rows[i].params for i in drawn]
        if len(drawn) == len(rows):
            return _draw(logits, params, *noise, self.nucleus)
        tokens = torch.empty(len(rows), dtype=torch.long, device=logits.device)
        greedy = [i for i, r in enumerate(rows) if not _is_drawn(r.params)]
        tokens[greedy] = greedy_tokens(logits[greedy])
        tokens[drawn] = _draw(logits[drawn], params, *noise, self.nucleus)
        return tokens

    def process(self, logits: torch.Tensor, rows: list[SampleRow], copy: bool = True) -> torch.Tensor:
        """Grammar masks, logit_bias and penalties (vLLM's order), on the rows that carry
        them; returns `logits` itself when no row does, else the processed logits (a copy,
        or `logits` changed in place when `copy` is False)."""
        masked = [i for i, r in enumerate(rows) if r.grammar is not None]
        biased = [i for i, r in enumerate(rows) if r.params.logit_bias]
        penalized = [i for i, r in enumerate(rows) if r.params.has_penalties]
        if not biased:
            self._bias = {}
        if not (masked or biased or penalized):
            return logits
        if copy:
            logits = logits.clone()
        if masked:
            self._apply_grammars(logits, rows, masked)
        if biased:
            self._apply_logit_bias(logits, rows, biased)
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

    def _apply_logit_bias(self, logits: torch.Tensor, rows: list[SampleRow], biased: list[int]) -> None:
        """Every biased row's entries added in one indexed accumulate."""
        cache: dict[int, tuple[SamplingParams, torch.Tensor, torch.Tensor]] = {}
        for i in biased:
            p = rows[i].params
            entry = self._bias.get(id(p))
            if entry is None or entry[0] is not p:  # (the cache holds p: its id is not reused)
                pairs = torch.tensor(p.logit_bias, dtype=torch.float64)
                entry = (p, pairs[:, 0].long().to(logits.device), pairs[:, 1].to(logits.dtype).to(logits.device))
            cache[id(p)] = entry
        self._bias = cache
        entries = [cache[id(rows[i].params)] for i in biased]
        counts = torch.tensor([len(e[1]) for e in entries], device=logits.device)
        row_idx = torch.repeat_interleave(torch.tensor(biased, device=logits.device), counts)
        logits.index_put_((row_idx, torch.cat([e[1] for e in entries])), torch.cat([e[2] for e in entries]),
                          accumulate=True)

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
