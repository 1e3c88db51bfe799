"""What the engine hands back for a request after each step."""
from __future__ import annotations

from dataclasses import dataclass, field

from .sampler import Logprobs


@dataclass
class RequestOutput:
    """What one step produced for one request (deltas, not cumulative).

    With n > 1 choices, outputs of every choice share the request id and carry their
    `index`; `finish_reason` is set on a choice's last output and `finished` on the
    request's last one (all choices done)."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None = None  # stop | length | abort | error
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    logprobs: list[Logprobs] = field(default_factory=list)
    stop_reason: str | int | None = None
    # On the output that carries the first token: seconds from arrival to first admitted
    # (queue), and from then to the first token (prefill, chunks and preemptions included).
    queue_time: float | None = None
    prefill_time: float | None = None
    # Prompt tokens the engine has processed (computed or found in the prefix cache): what
    # a request aborted before its first token still cost. With `report_prefill` set, a
    # prefill chunk that sampled nothing yields an output with no token carrying it.
    num_processed_prompt_tokens: int = 0
    index: int = 0
    # On a choice's first output when sampling.prompt_logprobs is set: one entry per
    # prompt token, None for the first (nothing predicts it).
    prompt_logprobs: list[Logprobs | None] | None = None
