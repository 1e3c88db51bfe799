"""Requests and their sampling parameters: plain data shared by scheduler and runner."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from .errors import InvalidRequestError
from .structured.spec import StructuredOutput


class Lane(enum.IntEnum):
    """Priority lanes: lower value is served first."""

    INTERACTIVE = 0
    STANDARD = 1
    BATCH = 2

    @classmethod
    def parse(cls, value: "Lane | str | int") -> "Lane":
        if isinstance(value, Lane):
            return value
        if isinstance(value, int):
            return cls(value)
        try:
            return cls[str(value).upper()]
        except KeyError:
            raise InvalidRequestError(f"unknown lane {value!r}; use interactive, standard or batch") from None


MAX_N = 64  # choices per request
MAX_LOGIT_BIAS = 300  # logit_bias entries per request (OpenAI's cap)
# What one request may make the engine produce: tokens over all its choices
# (n x max_tokens), and those tokens' logprob entries (x (1 + top logprobs)).
MAX_REQUEST_OUTPUT_TOKENS = 32_768
MAX_REQUEST_LOGPROB_ENTRIES = 131_072


def check_production(sequences: int, max_tokens: int, logprobs: int | None) -> None:
    """InvalidRequestError unless `sequences` x `max_tokens` (and x (1 + top logprobs))
    is within what one request may produce; `sequences` counts every choice of every
    prompt an API request carries."""
    total = sequences * max_tokens
    if total > MAX_REQUEST_OUTPUT_TOKENS:
        raise InvalidRequestError(
            f"max_tokens x n ({max_tokens} x {sequences} = {total}) is over the cap of "
            f"{MAX_REQUEST_OUTPUT_TOKENS} output tokens per request (max_request_output_tokens)")
    entries = total * (1 + logprobs) if logprobs is not None else 0
    if entries > MAX_REQUEST_LOGPROB_ENTRIES:
        raise InvalidRequestError(
            f"max_tokens x n x (1 + top_logprobs) ({max_tokens} x {sequences} x {1 + logprobs} = "
            f"{entries}) is over the cap of {MAX_REQUEST_LOGPROB_ENTRIES} logprob entries per request "
            "(max_request_logprob_entries)")


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 disables
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # top-n logprobs per generated token
    min_tokens: int = 0
    # vLLM's semantics: presence/frequency over output tokens, repetition over prompt + output.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # token id -> bias added to its logit; a mapping is normalized to sorted (id, bias) pairs.
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_p: float = 0.0
    structured_output: StructuredOutput | None = None
    # Choices generated from one prompt, prefilled once: choice i > 0 is admitted once
    # choice 0's prompt blocks are in the prefix cache; with a seed, choice i uses seed + i.
    n: int = 1
    # Top-n logprobs of every prompt token (OpenAI's echo + logprobs); the request then
    # computes its whole prompt itself (prefix-cache hits have no logits to report).
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise InvalidRequestError("max_tokens must be at least 1")
        if self.temperature < 0:
            raise InvalidRequestError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise InvalidRequestError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise InvalidRequestError("top_k must be >= 0")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise InvalidRequestError("logprobs must be between 0 and 20")
        if self.prompt_logprobs is not None and (isinstance(self.prompt_logprobs, bool) or not isinstance(
                self.prompt_logprobs, int) or not 0 <= self.prompt_logprobs <= 20):
            raise InvalidRequestError("prompt_logprobs must be between 0 and 20")
        if isinstance(self.n, bool) or not isinstance(self.n, int) or not 1 <= self.n <= MAX_N:
            raise InvalidRequestError(f"n must be an integer between 1 and {MAX_N}")
        self._check_production()
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        self._check_logit_processors()

    def _check_production(self) -> None:
        check_production(self.n, self.max_tokens, self.logprobs)

    def _check_logit_processors(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise InvalidRequestError(f"{name} must be between -2 and 2")
        if not 0 < self.repetition_penalty <= 2:
            raise InvalidRequestError("repetition_penalty must be in (0, 2]")
        if not 0 <= self.min_p <= 1:
            raise InvalidRequestError("min_p must be between 0 and 1")
        object.__setattr__(self, "logit_bias", normalize_logit_bias(self.logit_bias))
        if self.structured_output is not None and not isinstance(self.structured_output, StructuredOutput):
            raise InvalidRequestError("structured_output must be a StructuredOutput")

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids in logit_bias must exist in the model's vocabulary."""
        bad = [t for t, _ in self.logit_bias if t >= vocab_size]
        if bad:
            raise InvalidRequestError(f"logit_bias token ids must be below the vocabulary size {vocab_size}: {bad[:5]}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


def normalize_logit_bias(bias) -> tuple[tuple[int, float], ...]:
    """`logit_bias` as sorted (token id, bias) pairs, or InvalidRequestError (the cap on
    entries is checked before any is looked at)."""
    size = len(bias) if hasattr(bias, "__len__") else 0
    if size > MAX_LOGIT_BIAS:
        raise InvalidRequestError(f"logit_bias has {size} entries, over the cap of {MAX_LOGIT_BIAS} "
                                  "(max_logit_bias_entries)")
    try:
        items = list(bias.items() if hasattr(bias, "items") else bias)
        pairs = [(tok, value) for tok, value in items]
    except (TypeError, ValueError):
        raise InvalidRequestError("logit_bias must map token ids to numbers") from None
    out = {}
    for tok, value in pairs:
        # OpenAI sends the ids as JSON object keys, i.e. strings of digits.
        tid = int(tok) if isinstance(tok, str) and tok.strip().isdigit() else tok
        if isinstance(tid, bool) or not isinstance(tid, int) or tid < 0:
            raise InvalidRequestError(f"logit_bias keys must be token ids (non-negative integers), got {tok!r}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise InvalidRequestError(f"logit_bias values must be numbers between -100 and 100, got {value!r}")
        out[tid] = float(value)
    return tuple(sorted(out.items()))


@dataclass(frozen=True)
class AdapterRef:
    """Which LoRA adapter a request runs with. `digest` is the content identity.
    `mixture`: a mixture's components and their weights (engine/mixtures.py), in its
    canonical order; empty for a stored adapter."""

    name: str
    digest: str
    mixture: tuple[tuple[AdapterRef, float], ...] = ()


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_TIMEOUT = "timeout"
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self not in (RequestStatus.WAITING, RequestStatus.RUNNING)


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    lane: Lane = Lane.STANDARD
    adapter: AdapterRef | None = None
    # Requests with different salts never share prefix-cache blocks (tenant isolation).
    cache_salt: str = ""
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = field(default_factory=time.monotonic)
    # The structured-output matcher (engine.structured.grammar.RequestGrammar), if any.
    grammar: Any = None
    # Who sent it (the gateway's tenant id; "" outside a platform) and that tenant's
    # weight: tenant-fair scheduling shares each lane by weighted tokens served.
    tenant: str = ""
    tenant_weight: float = 1.0
    # Monotonic time after which the engine aborts it (finish reason "timeout"); None: never.
    deadline: float | None = None

    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    # Prompt tokens served from the prefix cache at first admission (for metering).
    num_cached_tokens: int = -1
    num_preemptions: int = 0
    block_ids: list[int] = field(default_factory=list)
    # Chained hashes of this request's full blocks, filled lazily by the block pool.
    block_hashes: list[bytes] = field(default_factory=list)
    stop_reason: str | int | None = None
    first_token_time: float | None = None
    # When it was first admitted to the running batch (queue time ends here).
    scheduled_time: float | None = None
    # The last time this request entered the waiting queue (aging counts from here).
    enqueue_time: float = field(default_factory=time.monotonic)
    # Choice 0 of the same n > 1 request: this one waits until that one's prompt is computed,
    # so its prompt blocks are prefix-cache hits rather than a second prefill.
    prefill_leader: "Request | None" = None
    # position -> (logprob, top-n) of prompt token `position`, when sampling.prompt_logprobs is set.
    prompt_logprobs: dict[int, Any] = field(default_factory=dict)
    # Its reader fell behind (AsyncEngine): it takes no steps, keeping its KV and its seat,
    # until the reader catches up.
    paused: bool = False

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise InvalidRequestError("the prompt is empty")

    def waits_for_leader(self) -> bool:
        """True while the choice this one shares a prompt with has not computed it yet."""
        lead = self.prefill_leader
        return lead is not None and not lead.status.finished and lead.num_computed_tokens < lead.num_prompt_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def token_slice(self, start: int, end: int) -> list[int]:
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p:end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - p]

    def stop_status(self, token: int, max_model_len: int) -> RequestStatus | None:
        """What `token`, just appended, ends this request with (stop_reason set), if anything."""
        sp = self.sampling
        if self.num_output_tokens >= sp.min_tokens:
            if not sp.ignore_eos and token in self.eos_token_ids:
                self.stop_reason = None
                return RequestStatus.FINISHED_STOPPED
            if token in sp.stop_token_ids:
                self.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if self.num_output_tokens >= sp.max_tokens or self.num_tokens >= max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    @property
    def adapter_digest(self) -> str:
        return self.adapter.digest if self.adapter else ""
