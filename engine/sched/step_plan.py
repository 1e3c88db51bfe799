"""What a step runs: the scheduler's plain-data output, and the plan it builds it in."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..request import AdapterRef


@dataclass(frozen=True)
class ScheduledSeq:
    request_id: str
    token_ids: list[int]  # the tokens whose KV is computed this step
    start_pos: int  # position of token_ids[0]
    block_ids: list[int]  # the request's whole block table
    sample: bool  # True when this step reaches the last known token
    adapter_slot: int  # the adapter's device row (AdapterMemory); -1: base model
    # The last `num_drafts` of token_ids are drafts to verify (speculative decoding): the
    # runner samples each of the last num_drafts + 1 positions.
    num_drafts: int = 0


@dataclass
class SchedulerOutput:
    seqs: list[ScheduledSeq] = field(default_factory=list)
    # (row, adapter) pairs the runner must load before executing this step.
    adapter_loads: list[tuple[int, AdapterRef]] = field(default_factory=list)
    # Adapters whose device pages went back to the pool since the last step.
    adapter_evictions: list[AdapterRef] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)


class Budget:
    """What one class of requests may still add to a step: `tokens`, and, for the lanes
    behind the foreground, `units` of measured cost, a decoded token costing
    `decode_weight` units and a prompt token `prompt_weight` (a chunk of one token is a
    decode)."""

    def __init__(self, tokens: int, units: float | None = None, decode_weight: float = 1.0,
                 prompt_weight: float = 1.0) -> None:
        self.tokens, self.units = tokens, units
        self.decode_weight, self.prompt_weight = decode_weight, prompt_weight

    def room(self, wanted: int) -> int:
        """How many of `wanted` tokens of one request fit (0: none)."""
        n = min(wanted, self.tokens)
        if self.units is None or n <= 0:
            return max(n, 0)
        if n == 1 or self.prompt_weight <= 0:
            return n if self._cost(n) <= self.units + 1e-9 else 0
        return max(0, min(n, int((self.units + 1e-9) / self.prompt_weight)))

    def exhausted(self) -> bool:
        return self.tokens <= 0 or (self.units is not None and self.units < min(self.decode_weight,
                                                                               self.prompt_weight) - 1e-9)

    def take(self, n: int) -> None:
        self.tokens -= n
        if self.units is not None:
            self.units -= self._cost(n)

    def give_back(self, n: int) -> None:
        self.tokens += n
        if self.units is not None:
            self.units += self._cost(n)

    def _cost(self, n: int) -> float:
        return self.decode_weight if n == 1 else self.prompt_weight * n


@dataclass
class StepPlan:
    """A step being planned: what it runs, and the budget each planned request drew on
    (a preempted request's tokens go back to that budget)."""

    out: SchedulerOutput
    scheduled: dict[str, ScheduledSeq] = field(default_factory=dict)
    charged: dict[str, Budget] = field(default_factory=dict)

    def add(self, seq: ScheduledSeq, budget: Budget) -> None:
        self.scheduled[seq.request_id] = seq
        self.charged[seq.request_id] = budget
        budget.take(len(seq.token_ids))

    def drop(self, request_id: str) -> None:
        seq = self.scheduled.pop(request_id, None)
        if seq is not None:
            self.charged.pop(request_id).give_back(len(seq.token_ids))
