"""Each error status through the live server, in OpenAI's error body."""
from __future__ import annotations

import dataclasses

import httpx
import openai
import pytest

from loraplex.platform.app import create_app
from loraplex.platform.assembly.engine_factory import build_engine
from tests.e2e.conftest import MAX_MODEL_LEN, LiveServer, tiny_engine_config

ERROR_KEYS = {"message", "type", "param", "code", "request_id"}


def _post(live, path: str, body=None, tenant: str = "acme", **kw) -> httpx.Response:
    headers = {"authorization": f"Bearer {live.keys[tenant]}", **kw.pop("headers", {})}
    return httpx.post(f"{live.url}{path}", json=body, headers=headers, timeout=60, **kw)


def test_400_bad_requests(live):
    client = live.client()
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=live.model, prompt="x", n=0)
    assert e.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=live.model, messages=[{"role": "pilot", "content": "x"}])
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=live.model, prompt="x", temperature=-1)
    r = _post(live, "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and set(r.json()["error"]) == ERROR_KEYS
    r = _post(live, "/v1/completions", [1, 2])
    assert r.status_code == 400


def test_a_big_body_is_refused_by_the_screening_process(live):
    """A schema over its cap in a body over the screening size: the 400 names the cap,
    found in the child process (the pool counts what the child refused), and the request after
    it is served as usual."""
    pool = live.app.state.parse_pool
    before = pool.screened.copy()
    schema = {"type": "object", "properties": {f"f{i}": {"type": "string", "description": "x" * 80}
                                               for i in range(pool.screen_bytes // 80)}}
    body = {"model": live.model, "messages": [{"role": "user", "content": "json"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "big", "schema": schema}}}
    r = _post(live, "/v1/chat/completions", body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"
    assert "max_schema_bytes" in r.json()["error"]["message"]
    assert pool.screened["refused"] == before["refused"] + 1
    small = _post(live, "/v1/chat/completions", {"model": live.model, "max_tokens": 2,
                                                 "messages": [{"role": "user", "content": "hi"}]})
    assert small.status_code == 200 and sum(pool.screened.values()) == sum(before.values()) + 1


def test_404_unknown_model_and_route(live):
    with pytest.raises(openai.NotFoundError) as e:
        live.client().completions.create(model="gpt-9", prompt="x")
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    r = httpx.get(f"{live.url}/v1/nothing-here")
    assert r.status_code == 404 and set(r.json()["error"]) == ERROR_KEYS
    r = httpx.get(f"{live.url}/v1/completions")
    assert r.status_code == 405


def test_413_prompt_too_long(live):
    client = live.client()
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(model=live.model, prompt="hello " * (MAX_MODEL_LEN + 10), max_tokens=1)
    assert e.value.status_code == 413 and e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.APIStatusError) as e:  # prompt fits, prompt + max_tokens does not
        client.completions.create(model=live.model, prompt="hello", max_tokens=MAX_MODEL_LEN)
    assert e.value.status_code == 413
    with pytest.raises(openai.APIStatusError) as e:
        client.chat.completions.create(model=live.model, stream=True, max_tokens=1,
                                       messages=[{"role": "user", "content": "hello " * MAX_MODEL_LEN}])
    assert e.value.status_code == 413


def test_429_with_retry_after(live):
    for stream in (False, True):
        with pytest.raises(openai.RateLimitError) as e:
            live.client("limited").completions.create(model=live.model, prompt="x", max_tokens=1, stream=stream)
        assert e.value.response.headers["retry-after"] == "7"
        assert "requests-per-minute" in e.value.body["message"]


def test_503_when_draining_and_probes(live):
    assert httpx.get(f"{live.url}/health").status_code == 200
    assert httpx.get(f"{live.url}/ready").json()["status"] == "ready"
    live.gateway.draining = True
    try:
        with pytest.raises(openai.InternalServerError) as e:
            live.client().completions.create(model=live.model, prompt="x", max_tokens=1)
        assert e.value.status_code == 503
        assert httpx.get(f"{live.url}/ready").status_code == 503
    finally:
        live.gateway.draining = False


@pytest.fixture(scope="module")
def overloaded(live, tiny_llama_dir):
    """The same database, but an engine that refuses every request (max_waiting=0)."""
    settings = dataclasses.replace(live.settings, engine=tiny_engine_config(tiny_llama_dir, max_waiting=0))
    engine = build_engine(settings)
    with LiveServer(create_app(settings, engine)) as server:
        yield server.url
    engine.shutdown()


def test_503_overloaded_with_retry_after(live, overloaded):
    client = openai.OpenAI(base_url=f"{overloaded}/v1", api_key=live.keys["acme"], max_retries=0)
    for stream in (False, True):
        with pytest.raises(openai.InternalServerError) as e:
            client.completions.create(model=live.model, prompt="x", max_tokens=1, stream=stream)
        assert e.value.status_code == 503 and e.value.response.headers["retry-after"] == "1"
        assert e.value.body["code"] == "overloaded"
