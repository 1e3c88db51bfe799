"""The platform's one lane parser: a client's lane (name or priority), an admin's lane name,
a stored one."""
from __future__ import annotations

import pytest

from loraplex.engine.request import Lane
from loraplex.platform.errors import BadRequestError
from loraplex.platform.lanes import LANES, lane_name, lane_named, parse_lane, parse_lane_name, stored_lane


def test_a_clients_lane_is_a_name_or_a_priority():
    assert parse_lane("Batch", "x") == Lane.BATCH and parse_lane(0, "x") == Lane.INTERACTIVE
    assert parse_lane("2", "x") == Lane.BATCH
    for bad in ("fast", 3, -1, True, None, 1.5, "²", "٢", "9" * 5000, 10**5000):
        with pytest.raises(BadRequestError, match="priority") as info:
            parse_lane(bad, "priority")
        assert info.value.param == "priority"


def test_an_admins_lane_name_is_stored_lower_case():
    assert parse_lane_name(" Batch ") == "batch"
    with pytest.raises(BadRequestError, match="unknown lane 'fast'; use one of interactive, standard, batch"):
        parse_lane_name("fast")
    with pytest.raises(BadRequestError):
        parse_lane_name("0")  # priorities are the API's, not the admin's


def test_names_round_trip():
    assert LANES == ("interactive", "standard", "batch")
    for lane in Lane:
        assert stored_lane(lane_name(lane)) is lane and lane_named(lane_name(lane).upper()) is lane
    assert lane_named("fast") is None
    with pytest.raises(KeyError):
        stored_lane("fast")
