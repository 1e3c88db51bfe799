"""What a step runs: the scheduler's plain-data output, and the plan it builds it in."""
from __future__ import annotations

from dataclasses import dataclass, field

from .request import AdapterRef


@dataclass(frozen=True)
class ScheduledSeq:
    request_id: str
    token_ids: list[int]  # the tokens whose KV is computed this step
    start_pos: int  # position of token_ids[0]
    block_ids: list[int]  # the request's whole block table
    sample: bool  # True when this step reaches the last known token
    adapter_slot: int  # -1: base model


@dataclass
class SchedulerOutput:
    seqs: list[ScheduledSeq] = field(default_factory=list)
    # (slot, adapter) pairs the runner must load before executing this step.
    adapter_loads: list[tuple[int, AdapterRef]] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)


@dataclass
class StepPlan:
    """A step being planned: what it runs, and the budget each planned request drew on
    (a preempted request's tokens go back to that budget)."""

    out: SchedulerOutput
    scheduled: dict[str, ScheduledSeq] = field(default_factory=dict)
    charged: dict[str, list[int]] = field(default_factory=dict)

    def add(self, seq: ScheduledSeq, budget: list[int]) -> None:
        self.scheduled[seq.request_id] = seq
        self.charged[seq.request_id] = budget
        budget[0] -= len(seq.token_ids)

    def drop(self, request_id: str) -> None:
        seq = self.scheduled.pop(request_id, None)
        if seq is not None:
            self.charged.pop(request_id)[0] += len(seq.token_ids)
