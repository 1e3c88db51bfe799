"""Speculative decoding: proposers of draft tokens. The scheduler decides which drafts a
step verifies (engine/sched/speculation.py); the runner samples every draft position."""
from .proposer import DraftProposer, NgramProposer, create_proposer

__all__ = ["DraftProposer", "NgramProposer", "create_proposer"]
