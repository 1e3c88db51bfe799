"""GAIE's `x-gateway-inference-objective` as a pool member receives it: a request's lane
may only go down from what its key allows, to a lane the tenant may use; configured
objective names map to lanes or GAIE priorities."""
from __future__ import annotations

import uuid

import pytest

from loraplex.engine.request import Lane
from loraplex.platform.tenancy.tenants import create_key, create_tenant


def _lane(oa, tenant_key: str, **headers: str) -> Lane:
    r = oa.client(tenant_key).completions.create(model=oa.model, prompt="x", max_tokens=1,
                                  extra_headers={k.replace("_", "-"): v for k, v in headers.items()})
    return next(ctx for ctx in oa.hooks.finished if ctx.request_id == r.id).lane


def test_an_objective_lowers_the_lane_and_never_raises_it(oa):
    acme, beta = oa.keys["acme"], oa.keys["beta"]  # interactive (may use every lane), standard
    assert _lane(oa, acme) == Lane.INTERACTIVE
    assert _lane(oa, acme, x_gateway_inference_objective="batch") == Lane.BATCH
    assert _lane(oa, beta, x_gateway_inference_objective="interactive") == Lane.STANDARD  # no 403: capped
    assert _lane(oa, acme, x_gateway_inference_objective="no-such-objective") == Lane.INTERACTIVE
    assert _lane(oa, acme, x_loraplex_lane="standard", x_gateway_inference_objective="batch") == Lane.BATCH
    assert _lane(oa, acme, x_loraplex_lane="batch", x_gateway_inference_objective="interactive") == Lane.BATCH


def test_only_to_a_lane_the_tenant_may_use(oa):
    name = f"t-{uuid.uuid4().hex[:6]}"
    create_tenant(oa.db, name, "interactive", ["interactive"])
    assert _lane(oa, create_key(oa.db, name), x_gateway_inference_objective="batch") == Lane.INTERACTIVE


def test_configured_objectives_map_to_lanes_or_gaie_priorities(oa, monkeypatch):
    from loraplex.platform.serving.gaie import parse_objective

    monkeypatch.setattr(oa.gateway, "objectives", {"sheddable": parse_objective("-10"),
                                                   "premium": parse_objective("100"),
                                                   "reports": parse_objective("standard")})
    acme = oa.keys["acme"]
    assert _lane(oa, acme, x_gateway_inference_objective="sheddable") == Lane.BATCH
    assert _lane(oa, acme, x_gateway_inference_objective="reports") == Lane.STANDARD
    assert _lane(oa, oa.keys["gamma"], x_gateway_inference_objective="premium") == Lane.BATCH


@pytest.mark.parametrize("value, lane", [("interactive", Lane.INTERACTIVE), ("1", Lane.INTERACTIVE),
                                         ("0", Lane.STANDARD), ("-1", Lane.BATCH), (" batch ", Lane.BATCH)])
def test_objective_values(value, lane):
    from loraplex.platform.serving.gaie import parse_objective

    assert parse_objective(value) == lane
    with pytest.raises(ValueError):
        parse_objective("high")
