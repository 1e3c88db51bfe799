"""Draft proposers: what a request's next tokens probably are, before the model says.

A draft is only a guess: the runner samples every drafted position with the request's
own model (its adapter included) and the scheduler keeps the longest prefix where the
sample equals the draft, plus the first sample that differs. Drafts here are
deterministic (one token per position), so this is exactly the rejection rule of
speculative sampling: a draft d is kept with probability p(d), and a rejected position's
token is drawn from p without d. Greedy output, and seeded sampled output, are token for
token what plain decoding gives.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np

from ..config import SpeculativeConfig
from ..request import Request


class DraftProposer(ABC):
    """Contract: `propose(req, k)` returns at most `k` draft tokens to follow `req`'s
    tokens so far (prompt and output), possibly none; it is called on the engine thread
    once per step for each decoding request the scheduler may speculate for, so its cost
    must stay small and bounded by the request's length. `forget(request_id)` drops what
    it keeps for a request that finished."""

    @abstractmethod
    def propose(self, req: Request, k: int) -> list[int]: ...

    def forget(self, request_id: str) -> None:
        return None


class NgramProposer(DraftProposer):
    """Prompt lookup: the latest earlier occurrence of the request's last n tokens (n from
    `prompt_lookup_max` down to `prompt_lookup_min`), and the tokens that followed it.
    Each request's tokens are kept in a growing int32 array, appended to as it decodes,
    so a proposal is a few vectorised comparisons over it, never a Python loop."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max
        self._tokens: dict[str, tuple[np.ndarray, int]] = {}

    def propose(self, req: Request, k: int) -> list[int]:
        arr, length = self._sync(req)
        if k <= 0 or length <= self.min_n:
            return []
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            start = _latest_match(arr, length, n)
            if start is not None:
                follow = start + n
                return arr[follow:min(follow + k, length)].tolist()
        return []

    def forget(self, request_id: str) -> None:
        self._tokens.pop(request_id, None)

    def _sync(self, req: Request) -> tuple[np.ndarray, int]:
        """The request's tokens as an array, appending only what is new since last time."""
        arr, length = self._tokens.get(req.request_id, (None, 0))
        total = req.num_tokens
        if arr is None or total < length:
            arr = np.empty(max(64, 2 * total), dtype=np.int32)
            length = 0
        if total > len(arr):
            grown = np.empty(2 * total, dtype=np.int32)
            grown[:length] = arr[:length]
            arr = grown
        if total > length:
            arr[length:total] = req.token_slice(length, total)
            length = total
        self._tokens[req.request_id] = (arr, length)
        return arr, length


def _latest_match(arr: np.ndarray, length: int, n: int) -> int | None:
    """Start of the latest occurrence of arr[length-n:length] that ends before the last
    token (so at least one token follows it), or None."""
    suffix = arr[length - n:length]
    cand = np.flatnonzero(arr[:length - n] == suffix[0])
    for j in range(1, n):
        if cand.size == 0:
            return None
        cand = cand[arr[cand + j] == suffix[j]]
    return int(cand[-1]) if cand.size else None


def create_proposer(config: SpeculativeConfig) -> DraftProposer | None:
    """The proposer `config.method` names, chosen once at start; None when speculation is off."""
    if config.method == "ngram":
        return NgramProposer(config)
    return None
