"""A client that goes away aborts its engine request at once."""
from __future__ import annotations

import httpx
import pytest

from tests.e2e.conftest import MAX_MODEL_LEN, engine_stats, wait_idle

LONG = MAX_MODEL_LEN - 16  # far more tokens than the request gets to generate


def _body(live, stream: bool) -> dict:
    return {"model": live.model, "prompt": "x", "max_tokens": LONG, "temperature": 0, "ignore_eos": True,
            "stream": stream}


def _last_finished(live, before: int):
    assert len(live.hooks.finished) > before, "the request never finished"
    return live.hooks.finished[-1]


def test_stream_disconnect_aborts_engine_request(live):
    assert wait_idle(live.engine)
    before = len(live.hooks.finished)
    headers = {"authorization": f"Bearer {live.keys['acme']}"}
    with httpx.Client(timeout=30) as client:
        with client.stream("POST", f"{live.url}/v1/completions", json=_body(live, True), headers=headers) as r:
            assert r.status_code == 200
            lines = r.iter_lines()  # keep it referenced: a dropped iterator closes the connection
            first = next(lines)
            assert first.startswith("data: {") and '"error"' not in first, first
            assert engine_stats(live.engine).running == 1
    # Leaving the block closed the connection mid-stream.
    assert wait_idle(live.engine, timeout=5)
    ctx = _last_finished(live, before)
    assert ctx.finish_reason == "abort" and ctx.num_output_tokens < LONG


def test_non_stream_disconnect_aborts_engine_request(live):
    assert wait_idle(live.engine)
    before = len(live.hooks.finished)
    headers = {"authorization": f"Bearer {live.keys['acme']}"}
    live.client("acme").models.list()  # the key is now cached: the request starts at once
    with pytest.raises(httpx.ReadTimeout):  # the tiny model would need ~0.25 s for all tokens
        httpx.post(f"{live.url}/v1/completions", json=_body(live, False), headers=headers, timeout=0.08)
    assert wait_idle(live.engine, timeout=5)
    ctx = _last_finished(live, before)
    assert ctx.finish_reason == "abort" and ctx.num_output_tokens < LONG
