"""The OpenAI API end to end, with the official `openai` client against a live server."""
from __future__ import annotations

import pytest

GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


def test_completion(live):
    r = live.client().completions.create(model=live.model, prompt="Hello there", max_tokens=5, **GREEDY)
    assert r.object == "text_completion" and r.model == live.model and r.id.startswith("cmpl-")
    c = r.choices[0]
    assert c.finish_reason == "length" and isinstance(c.text, str) and c.text
    assert r.usage.completion_tokens == 5 and r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + 5


def test_chat(live):
    r = live.client().chat.completions.create(model=live.model, messages=[{"role": "user", "content": "Hi!"}],
                                              max_completion_tokens=4, **GREEDY)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    msg = r.choices[0].message
    assert msg.role == "assistant" and msg.content
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 4


def test_chat_stream_with_usage_matches_non_stream(live):
    client, msgs = live.client(), [{"role": "user", "content": "Tell me a story"}]
    full = client.chat.completions.create(model=live.model, messages=msgs, max_tokens=8, **GREEDY)
    chunks = list(client.chat.completions.create(model=live.model, messages=msgs, max_tokens=8, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] == "length" and set(reasons[:-1]) == {None}


def test_completion_stream_without_usage(live):
    chunks = list(live.client().completions.create(model=live.model, prompt="Once upon", max_tokens=6,
                                                   stream=True, **GREEDY))
    assert all(getattr(c, "usage", None) is None for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"
    full = live.client().completions.create(model=live.model, prompt="Once upon", max_tokens=6, **GREEDY)
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text


def test_stop_and_seed(live):
    client = live.client()
    base = client.completions.create(model=live.model, prompt="abc", max_tokens=12, **GREEDY).choices[0].text
    stop = base[3:6]
    r = client.completions.create(model=live.model, prompt="abc", max_tokens=12, stop=[stop], **GREEDY)
    assert r.choices[0].finish_reason == "stop" and stop not in r.choices[0].text
    assert base.startswith(r.choices[0].text)
    a, b = (client.completions.create(model=live.model, prompt="abc", max_tokens=6, temperature=1.0, seed=7,
                                      top_p=0.9, extra_body={"top_k": 50}).choices[0].text for _ in range(2))
    assert a == b


def test_logprobs(live):
    r = live.client().chat.completions.create(model=live.model, messages=[{"role": "user", "content": "x"}],
                                              max_tokens=3, logprobs=True, top_logprobs=3, **GREEDY)
    content = r.choices[0].logprobs.content
    assert len(content) == 3
    for item in content:
        assert len(item.top_logprobs) == 3 and item.logprob <= 0
        assert item.logprob == pytest.approx(item.top_logprobs[0].logprob)  # greedy picks the top token
    r = live.client().completions.create(model=live.model, prompt="x", max_tokens=2, logprobs=2, **GREEDY)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 2 and len(lp.top_logprobs[0]) == 2 and lp.text_offset[0] == 0


def test_models_per_tenant(live):
    seen = {t: {m.id for m in live.client(t).models.list()} for t in ("acme", "beta", "gamma")}
    assert seen["acme"] == {live.model, "acme-private", "pub"}
    assert seen["beta"] == {live.model, "shared", "pub"}
    assert seen["gamma"] == {live.model, "pub"}
    card = live.client("acme").models.retrieve("acme-private")
    assert card.id == "acme-private" and card.owned_by == "loraplex"
    adapter_models = live.client("beta", base="/adapters/shared/v1").models.list()
    assert [m.id for m in adapter_models] == ["shared"]


def test_adapter_by_model_name_and_by_base_url(live):
    prompt = "The weather today"
    base = live.client("acme").completions.create(model=live.model, prompt=prompt, max_tokens=8, **GREEDY)
    by_name = live.client("acme").completions.create(model="acme-private", prompt=prompt, max_tokens=8, **GREEDY)
    by_url = live.client("acme", base="/adapters/acme-private/v1").completions.create(
        model="ignored-here", prompt=prompt, max_tokens=8, **GREEDY)
    assert by_name.model == by_url.model == "acme-private"
    assert by_name.choices[0].text == by_url.choices[0].text
    assert by_name.choices[0].text != base.choices[0].text  # the adapter changes the output
    chat = live.client("beta", base="/adapters/shared/v1").chat.completions.create(
        model="", messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True, **GREEDY)
    chunks = list(chat)
    assert chunks[0].model == "shared" and chunks[-1].choices[0].finish_reason == "length"


def test_hooks_see_every_request_with_final_counts(live):
    before = len(live.hooks.finished)
    r = live.client("beta").completions.create(model=live.model, prompt="count me", max_tokens=3, **GREEDY)
    ctx = live.hooks.finished[before]
    assert (ctx.principal.tenant, ctx.finish_reason, ctx.num_output_tokens) == ("beta", "length", 3)
    assert ctx.num_prompt_tokens == r.usage.prompt_tokens and ctx.request_id == r.id
    assert ctx.first_token_at is not None and ctx.finished_at >= ctx.first_token_at
