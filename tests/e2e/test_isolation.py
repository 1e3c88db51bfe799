"""Tenants cannot use, list or probe each other's private adapters; dead keys get 401;
lanes only go down."""
from __future__ import annotations

import datetime as dt
import time

import httpx
import openai
import pytest

from loraplex.engine.request import Lane
from loraplex.platform.tenancy.tenants import create_key, key_prefix, revoke_key

GREEDY = {"temperature": 0, "max_tokens": 2}


def _not_found_message(exc: openai.NotFoundError, name: str) -> str:
    return exc.value.body["message"].replace(name, "<name>")


def test_private_adapter_is_indistinguishable_from_a_missing_one(live):
    beta = live.client("beta")
    with pytest.raises(openai.NotFoundError) as private:
        beta.completions.create(model="acme-private", prompt="x", **GREEDY)
    with pytest.raises(openai.NotFoundError) as missing:
        beta.completions.create(model="no-such-adapter", prompt="x", **GREEDY)
    assert _not_found_message(private, "acme-private") == _not_found_message(missing, "no-such-adapter")
    assert private.value.body["code"] == missing.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        beta.chat.completions.create(model="acme-private", messages=[{"role": "user", "content": "x"}], **GREEDY)


@pytest.mark.parametrize("path", ["/adapters/acme-private/v1", "/adapters/no-such/v1"])
def test_cannot_probe_through_adapter_urls(live, path):
    client = live.client("beta", base=path)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="x", prompt="x", **GREEDY)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="x", messages=[{"role": "user", "content": "x"}], **GREEDY)
    with pytest.raises(openai.NotFoundError):
        client.models.list()
    with pytest.raises(openai.NotFoundError):
        live.client("beta").models.retrieve(path.split("/")[2])


def test_private_adapter_not_listed_for_others(live):
    for tenant in ("beta", "gamma"):
        assert "acme-private" not in {m.id for m in live.client(tenant).models.list()}


def test_bad_keys_get_401(live):
    for key in ("nonsense", "lpx_000000000000_" + "A" * 43, live.keys["acme"][:-2] + "zz"):
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{live.url}/v1", api_key=key, max_retries=0).models.list()
    r = httpx.post(f"{live.url}/v1/completions", json={"model": live.model, "prompt": "x"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_revoked_key_gets_401_within_the_cache_ttl(live):
    key = create_key(live.db, "beta")
    client = openai.OpenAI(base_url=f"{live.url}/v1", api_key=key, max_retries=0)
    client.completions.create(model=live.model, prompt="x", **GREEDY)  # valid and now cached
    revoke_key(live.db, key_prefix(key))
    time.sleep(live.settings.auth.cache_ttl + 0.1)
    with pytest.raises(openai.AuthenticationError) as e:
        client.completions.create(model=live.model, prompt="x", **GREEDY)
    assert "revoked" in e.value.body["message"]


def test_expired_key_gets_401(live):
    past = dt.datetime.now(dt.timezone.utc) - dt.timedelta(minutes=1)
    key = create_key(live.db, "beta", expires_at=past)
    with pytest.raises(openai.AuthenticationError) as e:
        openai.OpenAI(base_url=f"{live.url}/v1", api_key=key, max_retries=0).models.list()
    assert "expired" in e.value.body["message"]


def _lane_of_last_request(live) -> Lane:
    return live.hooks.admitted[-1].lane


@pytest.mark.parametrize("how", ["header", "priority"])
def test_tenant_cannot_raise_its_lane(live, how):
    beta = live.client("beta")  # tenant lane: standard
    kw = ({"extra_headers": {"x-loraplex-lane": "interactive"}} if how == "header"
          else {"extra_body": {"priority": "interactive"}})
    with pytest.raises(openai.PermissionDeniedError) as e:
        beta.completions.create(model=live.model, prompt="x", **GREEDY, **kw)
    assert "lower lane" in e.value.body["message"]
    beta.completions.create(model=live.model, prompt="x", **GREEDY)
    assert _lane_of_last_request(live) == Lane.STANDARD
    kw = ({"extra_headers": {"x-loraplex-lane": "batch"}} if how == "header" else {"extra_body": {"priority": 2}})
    beta.completions.create(model=live.model, prompt="x", **GREEDY, **kw)
    assert _lane_of_last_request(live) == Lane.BATCH


def test_lane_rules_for_batch_only_and_interactive_tenants(live):
    with pytest.raises(openai.PermissionDeniedError):
        live.client("gamma").completions.create(model=live.model, prompt="x", **GREEDY,
                                                extra_headers={"x-loraplex-lane": "standard"})
    live.client("acme").completions.create(model=live.model, prompt="x", **GREEDY)
    assert _lane_of_last_request(live) == Lane.INTERACTIVE
    with pytest.raises(openai.BadRequestError):
        live.client("acme").completions.create(model=live.model, prompt="x", **GREEDY,
                                               extra_headers={"x-loraplex-lane": "turbo"})
