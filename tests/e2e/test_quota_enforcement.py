"""Quotas and metering through a live server with the official openai client, on SQLite
and PostgreSQL: a budget under 50 concurrent requests, no leaks on any path (success,
disconnect, engine error, timeout, shutdown), and 429s that name the limit."""
from __future__ import annotations

import asyncio
import threading
import time

import httpx
import openai
import pytest
from loraplex.platform.app import create_app
from loraplex.platform.db.database import Database

from tests.e2e.conftest import MAX_MODEL_LEN
from tests.e2e.usage_support import (
    FAIL_MAX_TOKENS,
    ChaosEngine,
    CountingHooks,
    Server,
    counters,
    export_events,
    metered,  # noqa: F401 - fixture
    metered_settings,
)

GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


def _prompt_tokens(m, text: str) -> int:
    return len(m.engine.tokenizer.encode(text))


async def _one(client: openai.AsyncOpenAI, model: str, i: int, max_tokens: int) -> dict:
    """One request; its client-side view: ok/429, request id and usage."""
    try:
        if i % 2:
            stream = await client.completions.create(model=model, prompt="x", max_tokens=max_tokens, stream=True,
                                                     stream_options={"include_usage": True}, **GREEDY)
            chunks = [c async for c in stream]
            u = chunks[-1].usage
            return {"ok": True, "id": chunks[0].id, "prompt": u.prompt_tokens, "completion": u.completion_tokens}
        r = await client.completions.create(model=model, prompt="x", max_tokens=max_tokens, **GREEDY)
        return {"ok": True, "id": r.id, "prompt": r.usage.prompt_tokens, "completion": r.usage.completion_tokens}
    except openai.RateLimitError as e:
        return {"ok": False, "retry_after": int(e.response.headers["retry-after"]), "message": e.body["message"]}


def test_budget_under_50_concurrent_requests(metered):
    """50 requests at once against a budget that fits 10: billed <= budget, the rejected
    cost nothing, and every admitted request is billed exactly what its client saw."""
    per = _prompt_tokens(metered, "x") + 20
    budget = 10 * per + per // 2  # room for 10 and a half: the 11th must not get in
    name, key = metered.tenant("budget", token_budget=budget, budget_period="day")

    async def main():
        async with metered.async_client(key) as client:
            return await asyncio.gather(*(_one(client, metered.model, i, 20) for i in range(50)))

    results = asyncio.run(main())
    metered.settle()
    ok = [r for r in results if r["ok"]]
    rejected = [r for r in results if not r["ok"]]
    assert len(ok) == 10 and len(rejected) == 40
    assert all("token budget" in r["message"] and r["retry_after"] >= 1 for r in rejected)
    events = metered.events(name)
    billed = sum(e["total_tokens"] for e in events)
    assert billed <= budget
    assert {e["request_id"] for e in events} == {r["id"] for r in ok}  # the rejected left no event
    seen = {r["id"]: (r["prompt"], r["completion"]) for r in ok}
    assert all(seen[e["request_id"]] == (e["prompt_tokens"], e["completion_tokens"]) for e in events)
    c = counters(metered.db, name)
    assert c["budget_used"] == billed and c["in_flight"] == 0 and c["live_leases"] == 0


def _stream_disconnect(m, key: str) -> None:
    headers = {"authorization": f"Bearer {key}"}
    body = {"model": m.model, "prompt": "x", "max_tokens": 150, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=30) as client:
        with client.stream("POST", f"{m.url}/v1/completions", json=body, headers=headers) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            assert next(lines).startswith("data: {")


def _non_stream_timeout(m, key: str) -> None:
    headers = {"authorization": f"Bearer {key}"}
    body = {"model": m.model, "prompt": "x", "max_tokens": 150, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{m.url}/v1/completions", json=body, headers=headers, timeout=0.15)


def _stream_timeout(m, key: str) -> None:
    """The client's read timeout fires mid-stream: the server gets slow after the first chunk."""
    client = m.client(key, timeout=openai.Timeout(5, read=0.3))  # the client's own type, whatever its HTTP library
    with pytest.raises((openai.APITimeoutError, httpx.ReadTimeout)):
        for _ in client.completions.create(model=m.model, prompt="x", max_tokens=150, stream=True, **GREEDY):
            m.engine.delay = 0.5


def test_no_leaks_on_any_path(metered):
    """Successes, disconnects mid-stream, engine errors, client timeouts, 429s and 413s:
    afterwards nothing is in flight, no lease is live, every admitted request finished
    exactly once with one usage event, and the counters equal the tokens billed."""
    name, key = metered.tenant("leaky", max_concurrency=3, tpm=1_000_000, rpm=1000, token_budget=10**8,
                               budget_period="month")
    m = metered
    client = m.client(key)
    try:
        for i in range(3):  # successes, 3 non-streaming, 3 streaming
            client.completions.create(model=m.model, prompt="Hello", max_tokens=4 + i, **GREEDY)
            list(client.chat.completions.create(model=m.model, messages=[{"role": "user", "content": "Hi"}],
                                                max_tokens=3, stream=True, stream_options={"include_usage": True}))
        m.engine.delay = 0.01  # slow streams from here on
        _stream_disconnect(m, key)
        _non_stream_timeout(m, key)
        with pytest.raises(openai.InternalServerError):  # engine errors: a 500...
            client.completions.create(model=m.model, prompt="x", max_tokens=FAIL_MAX_TOKENS, **GREEDY)
        with pytest.raises(openai.APIError):  # ...or an error event in the stream
            list(client.completions.create(model=m.model, prompt="x", max_tokens=FAIL_MAX_TOKENS, stream=True,
                                           **GREEDY))
        _stream_timeout(m, key)
        m.engine.delay = 0.01
        with pytest.raises(openai.APIStatusError) as e:  # 413: refused before admission
            client.completions.create(model=m.model, prompt="hello " * (MAX_MODEL_LEN + 10), max_tokens=1)
        assert e.value.status_code == 413
        # A client that timed out frees its seat once the server sees it leave: only then
        # are all three seats free for the burst.
        m.settle()
        # Six at once against max-concurrency 3: three get 429 (and take nothing).
        barrier = threading.Barrier(6)
        statuses: list[int] = []

        def slow_request():
            barrier.wait()
            try:
                client.completions.create(model=m.model, prompt="x", max_tokens=40, **GREEDY)
                statuses.append(200)
            except openai.RateLimitError as exc:
                assert "max-concurrency limit of 3" in exc.body["message"]
                statuses.append(429)

        threads = [threading.Thread(target=slow_request) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(statuses) == [200] * 3 + [429] * 3
    finally:
        m.engine.delay = 0.0
    m.settle()
    events = m.events(name)
    ids = {e["request_id"] for e in events}
    assert len(events) == len(ids) == 6 + 1 + 1 + 2 + 1 + 3
    assert ids == m.hooks.admitted(name), "an admitted request has no usage event (or the reverse)"
    assert all(m.hooks.admits[rid] == m.hooks.finishes[rid] == 1 for rid in ids), "finish ran twice or never"
    statuses = {e["status"] for e in events}
    assert {"aborted", "error", "length"} <= statuses, statuses
    c = counters(m.db, name)
    billed = sum(e["total_tokens"] for e in events)
    assert c == {"in_flight": 0, "budget_used": billed, "tpm_used": billed, "live_leases": 0}


def test_shutdown_finishes_and_flushes(metered, tiny_engine):
    """Streams still running when the server stops are metered (aborted) and settled, and
    the writer flushes their events before the app exits."""
    name, key = metered.tenant("shut", max_concurrency=5, token_budget=10**6)
    settings = metered_settings(metered.settings, metered.settings.db_url)
    chaos = ChaosEngine(tiny_engine)
    chaos.delay = 0.02  # 200 tokens: 4 s, well past the 0.3 s graceful shutdown
    hooks = CountingHooks(settings)
    server = Server(create_app(settings, chaos, hooks=hooks), graceful=0.3).__enter__()
    started = threading.Barrier(3)
    errors: list = []

    def stream():
        try:
            c = openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=30)
            it = iter(c.completions.create(model=metered.model, prompt="x", max_tokens=200, stream=True, **GREEDY))
            next(it)
            started.wait()
            for _ in it:
                pass
        except Exception as exc:  # noqa: BLE001 - the server going away ends the stream
            errors.append(exc)

    threads = [threading.Thread(target=stream) for _ in range(2)]
    for t in threads:
        t.start()
    started.wait()
    server.stop()  # lifespan shutdown ran: hooks closed, writer flushed
    for t in threads:
        t.join(30)
    assert hooks.open_requests == 0 and len(hooks.admits) == 2
    assert all(hooks.finishes[rid] == 1 for rid in hooks.admits)
    db = Database(settings.db_url)
    try:
        events = export_events(db, name)
        assert len(events) == 2 and {e["status"] for e in events} == {"aborted"}
        assert all(0 < e["completion_tokens"] < 200 for e in events)
        c = counters(db, name)
        assert c["in_flight"] == 0 and c["live_leases"] == 0
        assert c["budget_used"] == sum(e["total_tokens"] for e in events)
    finally:
        db.dispose()


def test_429_rate_limits_name_the_limit_and_retry_after(metered):
    name, key = metered.tenant("rpm", rpm=2)
    client = metered.client(key)
    if time.time() % 60 > 55:  # keep the three requests in one minute window
        time.sleep(60 - time.time() % 60 + 0.1)
    for _ in range(2):
        client.completions.create(model=metered.model, prompt="x", max_tokens=1)
    for stream in (False, True):
        with pytest.raises(openai.RateLimitError) as e:
            client.completions.create(model=metered.model, prompt="x", max_tokens=1, stream=stream)
        assert f"tenant {name} is over its requests-per-minute limit of 2" in e.value.body["message"]
        assert 1 <= int(e.value.response.headers["retry-after"]) <= 60
        assert e.value.body["type"] == "rate_limit_error" and e.value.body["code"] == "rate_limit_exceeded"
    name2, key2 = metered.tenant("tpm", tpm=30)
    with pytest.raises(openai.RateLimitError) as e:
        metered.client(key2).completions.create(model=metered.model, prompt="x", max_tokens=40)
    assert "more than its whole tokens-per-minute of 30; lower max_tokens" in e.value.body["message"]
    metered.settle()
    assert len(metered.events(name)) == 2 and metered.events(name2) == []
    text = httpx.get(f"{metered.url}/metrics").text
    series = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("loraplex:") and not line.startswith("#")}
    assert series['loraplex:quota_rejections_total{limit="rpm"}'] >= 2
    assert series['loraplex:quota_rejections_total{limit="tpm"}'] >= 1
    assert series["loraplex:usage_events_written_total"] >= 2 and series["loraplex:usage_events_pending"] == 0


def test_a_prompt_list_reserves_and_bills_the_whole_request(metered):
    """Admission reserves every prompt x n x max_tokens: a list over the budget is refused
    whole though each prompt alone would fit; one that fits is one usage event, billed
    the sum of its prompts' tokens, and settles the counters to it."""
    prompts = ["one two", "three", "four five six"]
    tokens = sum(_prompt_tokens(metered, p) for p in prompts)
    reserve = tokens + 3 * 2 * 10
    name, key = metered.tenant("plist", token_budget=reserve - 1, budget_period="day")
    client = metered.client(key)
    with pytest.raises(openai.RateLimitError) as e:
        client.completions.create(model=metered.model, prompt=prompts, n=2, max_tokens=10, **GREEDY)
    assert "token budget" in e.value.body["message"]
    client.completions.create(model=metered.model, prompt=prompts[0], n=2, max_tokens=10, **GREEDY)  # alone: fits
    name, key = metered.tenant("plist", token_budget=reserve, budget_period="day")
    r = metered.client(key).completions.create(model=metered.model, prompt=prompts, n=2, max_tokens=10, stream=True,
                                               stream_options={"include_usage": True}, **GREEDY)
    chunks = list(r)
    usage = chunks[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (tokens, 60)
    metered.settle()
    events = metered.events(name)
    assert len(events) == 1 and events[0]["request_id"] == chunks[0].id
    assert (events[0]["prompt_tokens"], events[0]["completion_tokens"]) == (tokens, 60)
    c = counters(metered.db, name)
    assert c["budget_used"] == tokens + 60 and c["in_flight"] == 0 and c["live_leases"] == 0
