"""Two gateways over two engine workers, as real processes (see conftest.py): the outputs
of `serve`, adapter affinity and spill, adapters published through one gateway served by
every worker through the other, one quota across gateways, a worker killed mid-stream and
a worker drained by SIGTERM."""
from __future__ import annotations

import signal
import time
import uuid

import httpx
import openai
import pytest

from loraplex.platform.quotas.limits import set_quota
from loraplex.platform.tenancy.tenants import create_key, create_tenant
from tests.e2e.fleet import processes as P
from tests.e2e.usage_support import counters, export_events

GREEDY = {"temperature": 0, "max_tokens": 12}
LONG = {"max_tokens": 230, "stream": True, "extra_body": {"ignore_eos": True}}


def _counts(fleet, name: str, digest: str) -> list[float]:
    return [P.adapter_requests(w, name, digest) for w in fleet.workers]


def _delta(before: list[float], after: list[float]) -> list[float]:
    return [a - b for a, b in zip(after, before)]


def _tenant(fleet, **limits) -> tuple[str, str]:
    name = f"t-{uuid.uuid4().hex[:6]}"
    create_tenant(fleet.db, name)
    if limits:
        set_quota(fleet.db, name, **limits)
    return name, create_key(fleet.db, name)


def _hold(client: openai.OpenAI, model: str, n: int) -> list:
    """`n` long streams, each in flight (its first chunk received) before the next opens."""
    streams = []
    for i in range(n):
        s = client.completions.create(model=model, prompt=f"hold {i}", **LONG)
        it = iter(s)
        next(it)
        streams.append(it)
    return streams


def _drain(streams: list) -> None:
    for it in streams:
        for _ in it:
            pass


def test_greedy_outputs_match_serve(fleet):
    ref = fleet.serve_client()
    assert ref.models.list().data[0].id == fleet.model
    for model in (fleet.model, "ad1", "ad2"):
        for prompt in ("The quick brown fox", "Once upon a time, in a land"):
            want = ref.completions.create(model=model, prompt=prompt, **GREEDY).choices[0].text
            for g in (0, 1):
                got = fleet.client(g).completions.create(model=model, prompt=prompt, **GREEDY).choices[0].text
                assert got == want, (model, prompt, g)
        messages = [{"role": "user", "content": "Say something"}]
        want = ref.chat.completions.create(model=model, messages=messages, **GREEDY).choices[0].message.content
        chunks = fleet.client(1).chat.completions.create(model=model, messages=messages, stream=True, **GREEDY)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want


def test_prompt_lists_fan_out_across_workers_and_match_serve(fleet):
    """A list of prompts with n: the gateway sends one request per prompt to the workers
    and answers as `serve` does, streamed or not; one usage event for the request."""
    name, key = _tenant(fleet)
    prompts = ["The quick brown fox", [5, 6, 7, 8, 9], "Once upon a time, in a land"]
    kw = dict(prompt=prompts, n=2, **GREEDY)
    for model in (fleet.model, "ad1"):
        want = fleet.serve_client().completions.create(model=model, **kw)
        got = fleet.client(0, key).completions.create(model=model, **kw)
        assert [(c.index, c.text) for c in got.choices] == [(c.index, c.text) for c in want.choices]
        assert got.usage.prompt_tokens == want.usage.prompt_tokens
        assert got.usage.completion_tokens == want.usage.completion_tokens == 3 * 2 * 12
        texts: dict[int, str] = {}
        for chunk in fleet.client(1, key).completions.create(model=model, stream=True, **kw):
            for c in chunk.choices:
                texts[c.index] = texts.get(c.index, "") + c.text
        assert [texts[i] for i in range(6)] == [c.text for c in want.choices]
    deadline = time.monotonic() + 30
    while len(events := export_events(fleet.db, name)) < 4:
        assert time.monotonic() < deadline, events
        time.sleep(0.2)
    assert len(events) == 4 and all(e["completion_tokens"] == 72 for e in events)
    assert {e["prompt_tokens"] for e in events} == {want.usage.prompt_tokens}



def test_a_gateway_tokenizes_as_serve_does(fleet):
    """/tokenize and /detokenize on a gateway use the tokenizer a worker described."""
    body = {"messages": [{"role": "user", "content": "Count the tokens"}], "return_token_strs": True}
    want = httpx.post(fleet.serve.url + "/tokenize", json=body, timeout=60,
                      headers={"authorization": f"Bearer {fleet.serve_key}"}).json()
    got = httpx.post(fleet.gateways[1].url + "/adapters/ad1/tokenize", json=body, timeout=60,
                     headers={"authorization": f"Bearer {fleet.key}"}).json()
    assert got == want and got["count"] > 0
    text = httpx.post(fleet.gateways[0].url + "/detokenize", json={"tokens": got["tokens"]}, timeout=60,
                      headers={"authorization": f"Bearer {fleet.key}"}).json()["prompt"]
    assert "Count the tokens" in text


def test_an_adapter_lands_on_its_home_worker_and_spills_when_overloaded(fleet):
    digest = fleet.digests["ad2"]
    before = _counts(fleet, "ad2", digest)
    for i in range(4):  # through both gateways: they agree on the home
        fleet.client(i % 2).completions.create(model="ad2", prompt=f"home {i}", max_tokens=2, temperature=0)
    delta = _delta(before, _counts(fleet, "ad2", digest))
    assert sorted(delta) == [0, 4], delta
    home = delta.index(4)

    before = _counts(fleet, "ad2", digest)
    streams = _hold(fleet.client(0), "ad2", 4)  # past the bounded load (1 + epsilon) x mean
    _drain(streams)
    delta = _delta(before, _counts(fleet, "ad2", digest))
    assert sum(delta) == 4 and delta[home] >= 2 and delta[1 - home] >= 1, delta


def test_an_adapter_uploaded_through_one_gateway_is_served_by_every_worker_through_the_other(fleet, tiny_adapters):
    files = [("files", (n, (tiny_adapters["ad3"] / n).read_bytes()))
             for n in ("adapter_config.json", "adapter_model.safetensors")]
    r = httpx.post(fleet.gateways[0].url + "/admin/api/adapters", data={"name": "ad3", "public": "true"},
                   files=files, headers={"authorization": f"Bearer {P.ADMIN_TOKEN}"}, timeout=60)
    assert r.status_code == 201, r.text
    digest = r.json()["digest"]
    seen = httpx.get(fleet.gateways[1].url + "/admin/api/adapters/ad3", timeout=60,
                     headers={"authorization": f"Bearer {P.ADMIN_TOKEN}"}).json()
    assert seen["digest"] == digest and seen["residency"] != "missing"  # in the shared store (or on a worker)

    want = fleet.serve_client().completions.create(model="ad3", prompt="Uploaded", **GREEDY).choices[0].text
    via2 = fleet.client(1)
    deadline = time.monotonic() + 15  # gateway 2 learns the tenant's new adapter within its auth cache TTL
    while True:
        try:
            got = via2.completions.create(model="ad3", prompt="Uploaded", **GREEDY).choices[0].text
            break
        except openai.NotFoundError:
            assert time.monotonic() < deadline, "gateway 2 never saw the adapter"
            time.sleep(0.5)
    assert got == want
    _drain(_hold(via2, "ad3", 4))  # spills: the other worker fetches it from the shared store too
    assert all(n >= 1 for n in _counts(fleet, "ad3", digest)), _counts(fleet, "ad3", digest)


def test_vllms_load_lora_adapter_through_a_gateway_reaches_every_worker(fleet, tiny_adapters):
    """llm-d's adapter sidecar calls /v1/load_lora_adapter on a pool member: published to
    the shared store, served through the other gateway by whichever worker gets it."""
    admin = {"authorization": f"Bearer {P.ADMIN_TOKEN}"}
    r = httpx.post(fleet.gateways[0].url + "/v1/load_lora_adapter", headers=admin, timeout=60,
                   json={"lora_name": "side", "lora_path": str(tiny_adapters["ad3"])})
    assert r.status_code == 200, r.text
    want = fleet.serve_client().completions.create(model="ad3", prompt="Sidecar", **GREEDY).choices[0].text
    via2 = fleet.client(1)
    deadline = time.monotonic() + 15  # within gateway 2's auth cache TTL
    while True:
        try:
            got = via2.completions.create(model="side", prompt="Sidecar", **GREEDY).choices[0].text
            break
        except openai.NotFoundError:
            assert time.monotonic() < deadline, "gateway 2 never saw the adapter"
            time.sleep(0.5)
    assert got == want
    r = httpx.post(fleet.gateways[1].url + "/v1/unload_lora_adapter", headers=admin, timeout=60,
                   json={"lora_name": "side"})
    assert r.status_code == 200, r.text


def test_a_gateway_reports_the_fleet_on_its_metrics_port(fleet):
    fleet.client(0).completions.create(model="ad1", prompt="metrics", max_tokens=2)
    text = httpx.get(f"http://127.0.0.1:{fleet.metrics_port}/metrics", timeout=10).text
    assert P.metric(text, "loraplex:adapter_requests_total", adapter="ad1") >= 1
    assert "vllm:num_requests_running" in text and "vllm:kv_cache_usage_perc" in text


def test_one_quota_holds_across_both_gateways(fleet):
    _, key = _tenant(fleet, rpm=4)
    if time.time() % 60 > 50:
        time.sleep(60 - time.time() % 60 + 0.2)
    statuses = []
    for i in range(10):
        try:
            fleet.client(i % 2, key).completions.create(model=fleet.model, prompt="q", max_tokens=1)
            statuses.append(200)
        except openai.RateLimitError:
            statuses.append(429)
    assert statuses.count(200) == 4 and statuses.count(429) == 6, statuses


def _home(fleet, name: str) -> int:
    before = _counts(fleet, name, fleet.digests[name])
    fleet.client(0).completions.create(model=name, prompt="where", max_tokens=1)
    return _delta(before, _counts(fleet, name, fleet.digests[name])).index(1)


def test_a_worker_killed_mid_stream(fleet):
    tenant, key = _tenant(fleet, max_concurrency=50)
    home = _home(fleet, "ad1")
    dead, survivor = fleet.workers[home], fleet.workers[1 - home]
    it = iter(fleet.client(0, key).completions.create(model="ad1", prompt="kill", **LONG))
    received = [next(it) for _ in range(3)]
    dead.kill9()
    with pytest.raises(openai.APIError):  # an error event, not a hang
        for chunk in it:
            received.append(chunk)

    deadline = time.monotonic() + 20
    while not (events := export_events(fleet.db, tenant)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(events) == 1 and 3 <= events[0]["completion_tokens"] < 230, events
    assert counters(fleet.db, tenant)["in_flight"] == 0 and counters(fleet.db, tenant)["live_leases"] == 0

    before = P.adapter_requests(survivor, "ad1", fleet.digests["ad1"])
    for g in (0, 1):  # gateway 2 has not seen it die: its first try fails over before any output
        assert fleet.client(g, key).completions.create(model="ad1", prompt="after", max_tokens=2).choices
    assert P.adapter_requests(survivor, "ad1", fleet.digests["ad1"]) - before == 2

    fleet.restart(dead)
    deadline = time.monotonic() + 30
    # The survivor holds ad1 now and keeps it while load allows: past the bound, the
    # restarted worker takes the spill once both gateways' health checks let it back in.
    while P.adapter_requests(dead, "ad1", fleet.digests["ad1"]) == 0:
        assert time.monotonic() < deadline, "the restarted worker never rejoined"
        for g in (0, 1):
            _drain(_hold(fleet.client(g, key), "ad1", 3))
        time.sleep(0.5)


def test_sigterm_drains_a_worker(fleet):  # last: it leaves one worker stopped
    home = _home(fleet, "ad1")
    draining, other = fleet.workers[home], fleet.workers[1 - home]
    it = iter(fleet.client(0).completions.create(model="ad1", prompt="drain", **LONG))
    chunks = [next(it)]
    draining.signal(signal.SIGTERM)
    before = P.adapter_requests(other, "ad1", fleet.digests["ad1"])
    assert fleet.client(1).completions.create(model="ad1", prompt="meanwhile", max_tokens=2).choices
    chunks += list(it)  # the running request finishes
    assert chunks[-1].choices[0].finish_reason == "length"
    assert draining.popen.wait(60) == 0
    assert P.adapter_requests(other, "ad1", fleet.digests["ad1"]) - before == 1
