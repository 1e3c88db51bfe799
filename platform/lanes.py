"""The platform's one vocabulary for lanes: the engine's `Lane`, named by its lower-case
name everywhere a lane is stored or shown (database, API, metrics, usage exports)."""
from __future__ import annotations

from loraplex.engine.request import Lane

__all__ = ["LANES", "Lane", "lane_name", "lane_named"]


def lane_name(lane: Lane) -> str:
    return lane.name.lower()


LANES: tuple[str, ...] = tuple(lane_name(lane) for lane in sorted(Lane))  # highest priority first


def lane_named(name: str) -> Lane | None:
    """The lane of a stored or requested name ("batch", " Batch "), None for an unknown one."""
    try:
        return Lane[str(name).strip().upper()]
    except KeyError:
        return None
