"""The Gateway API Inference Extension's request headers, as a pool member receives them.

- `x-gateway-inference-objective` names an InferenceObjective: the lane a request runs
  in. A lane's name (interactive, standard, batch) is itself; other names map through
  `Settings.inference_objectives` (`--inference-objective NAME=LANE|PRIORITY`), where a
  GAIE priority above 0 is interactive, 0 standard and below 0 (sheddable) batch. An
  unknown objective changes nothing (GAIE's own default is priority 0: no preference).
  It never lifts a request above what its key allows: it may only lower the lane, and
  only to a lane the tenant may use. The inference gateway sets it for whole routes, so
  asking too high is not the client's error (unlike `x-loraplex-lane`, a 403).
- `x-gateway-inference-fairness-id` is the fairness key where no loraplex tenant is known
  (a worker reached without one): requests with one id share a tenant-fair share.
"""
from __future__ import annotations

from collections.abc import Mapping

from loraplex.platform.lanes import Lane, lane_named

OBJECTIVE_HEADER = "x-gateway-inference-objective"
FAIRNESS_HEADER = "x-gateway-inference-fairness-id"
MAX_HEADER_CHARS = 128


def lane_of_priority(priority: int) -> Lane:
    """GAIE's InferenceObjective priority as a lane: critical, default, sheddable."""
    return Lane.INTERACTIVE if priority > 0 else Lane.STANDARD if priority == 0 else Lane.BATCH


def parse_objective(value: str) -> Lane:
    """A configured objective's lane: a lane name or a GAIE priority (an integer)."""
    lane = lane_named(value)
    if lane is not None:
        return lane
    try:
        return lane_of_priority(int(value))
    except ValueError:
        raise ValueError(f"an inference objective maps to interactive, standard, batch or an integer priority, "
                         f"got {value!r}") from None


def _sane(value: str | None) -> str | None:
    if not value or len(value) > MAX_HEADER_CHARS or not value.isascii() or not value.isprintable():
        return None
    return value.strip() or None


def objective_lane(value: str | None, objectives: Mapping[str, Lane]) -> Lane | None:
    """The lane the objective header asks for; None: no objective, or one unknown here."""
    name = _sane(value)
    if name is None:
        return None
    lane = objectives.get(name)
    return lane if lane is not None else lane_named(name)


def lower_lane(current: Lane, asked: Lane | None, allowed: frozenset[Lane] | None = None) -> Lane:
    """`asked` when it is lower than `current` (and, with `allowed`, one of them); else `current`."""
    if asked is None or asked <= current or (allowed is not None and asked not in allowed):
        return current
    return asked


def fairness_key(value: str | None) -> str | None:
    """The fairness id as a tenant key for the engine's fair scheduling; None: none usable."""
    name = _sane(value)
    return f"gaie:{name}" if name is not None else None
