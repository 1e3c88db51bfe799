"""The platform's one vocabulary for lanes: the engine's `Lane`, named by its lower-case
name everywhere a lane is stored or shown (database, API, metrics, usage exports). The
platform parses lanes here only."""
from __future__ import annotations

from loraplex.engine.request import Lane

from loraplex.platform.errors import BadRequestError

__all__ = ["LANES", "Lane", "lane_name", "lane_named", "parse_lane", "parse_lane_name", "stored_lane"]


def lane_name(lane: Lane) -> str:
    return lane.name.lower()


LANES: tuple[str, ...] = tuple(lane_name(lane) for lane in sorted(Lane))  # highest priority first


def lane_named(name: str) -> Lane | None:
    """The lane of a stored or requested name ("batch", " Batch "), None for an unknown one."""
    try:
        return Lane[str(name).strip().upper()]
    except KeyError:
        return None


def stored_lane(name: str) -> Lane:
    """The lane of a name the database holds (validated when written: KeyError otherwise)."""
    return Lane[name.upper()]


def parse_lane(value: object, param: str) -> Lane:
    """A client's lane: 'interactive'|'standard'|'batch' or 0|1|2 (0 is the highest
    priority); BadRequestError naming `param` otherwise."""
    if isinstance(value, str):
        lane = lane_named(value)
        if lane is None and value.strip() in ("0", "1", "2"):
            value = int(value.strip())
        elif lane is not None:
            return lane
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 2:
        return Lane(value)
    raise BadRequestError(f"{param} must be one of {', '.join(LANES)} (or 0, 1, 2)", param)


def parse_lane_name(value: str) -> str:
    """An admin's lane name, as stored ("batch"); BadRequestError for an unknown one."""
    lane = str(value).strip().lower()
    if lane not in LANES:
        raise BadRequestError(f"unknown lane {value!r}; use one of {', '.join(LANES)}")
    return lane
