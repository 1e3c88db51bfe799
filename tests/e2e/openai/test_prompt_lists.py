"""Several prompts in one /v1/completions request, with the official openai client: lists
of strings and of token-id lists, with `n`, `best_of`, `echo` and streaming. Each prompt
gets what it gets alone; choices are numbered prompt-major; usage and metering count
the whole request once."""
from __future__ import annotations

import json
import random
import time

import httpx
import openai
import pytest

from tests.e2e.conftest import wait_idle


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


SAMPLED = dict(max_tokens=6, temperature=1.0, seed=13, extra_body={"ignore_eos": True})


def _alone(client: openai.OpenAI, model: str, prompt, **kw) -> openai.types.Completion:
    return client.completions.create(model=model, prompt=prompt, **kw)


def test_token_id_lists_with_n_are_indexed_prompt_major(oa):
    client = oa.client()
    prompts = [_ids(5, 1), _ids(23, 2), _ids(9, 3)]
    r = client.completions.create(model=oa.model, prompt=prompts, n=2, **SAMPLED)
    assert [c.index for c in r.choices] == list(range(6))
    for p, prompt in enumerate(prompts):
        alone = _alone(client, oa.model, prompt, n=2, **SAMPLED)
        assert [c.text for c in r.choices[2 * p:2 * p + 2]] == [c.text for c in alone.choices]
    assert r.usage.prompt_tokens == sum(map(len, prompts))
    assert r.usage.completion_tokens == 3 * 2 * 6
    metered = [ctx for ctx in oa.hooks.finished if ctx.request_id == r.id]
    assert len(metered) == 1  # one usage event for the HTTP request
    m = metered[0]
    assert (m.num_prompt_tokens, m.num_output_tokens, m.max_tokens) == (sum(map(len, prompts)), 36, 36)


def test_strings_with_an_adapter_and_echo(oa):
    client = oa.client()
    prompts = ["The sea", "Once upon a time there was", "Hi"]
    kw = dict(max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    r = client.completions.create(model="pub", prompt=prompts, echo=True, logprobs=1, **kw)
    assert len(r.choices) == 3
    for p, prompt in enumerate(prompts):
        alone = _alone(client, "pub", prompt, echo=True, logprobs=1, **kw).choices[0]
        assert r.choices[p].text == alone.text and r.choices[p].text.startswith(prompt)
        assert r.choices[p].logprobs.token_logprobs == pytest.approx(alone.logprobs.token_logprobs, abs=1e-5)
        assert r.choices[p].logprobs.tokens == alone.logprobs.tokens


def test_best_of_is_per_prompt(oa):
    client = oa.client()
    prompts = ["Once upon a time", "The weather"]
    kw = dict(max_tokens=5, temperature=1.0, seed=4, best_of=3, n=2, extra_body={"ignore_eos": True})
    r = client.completions.create(model=oa.model, prompt=prompts, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    for p, prompt in enumerate(prompts):
        alone = _alone(client, oa.model, prompt, **kw)
        assert [c.text for c in r.choices[2 * p:2 * p + 2]] == [c.text for c in alone.choices]
    assert r.usage.completion_tokens == 2 * 3 * 5  # every generated choice is counted


def test_streaming_interleaves_choices_by_index(oa):
    client = oa.client()
    prompts = ["alpha beta", "gamma", "delta epsilon zeta"]
    whole = client.completions.create(model=oa.model, prompt=prompts, n=2, **SAMPLED)
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    order: list[int] = []
    usage = None
    stream = client.completions.create(model=oa.model, prompt=prompts, n=2, stream=True,
                                       stream_options={"include_usage": True}, **SAMPLED)
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            order.append(c.index)
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    assert sorted(texts) == list(range(6))
    assert [texts[i] for i in range(6)] == [c.text for c in whole.choices]
    assert [reasons[i] for i in range(6)] == [c.finish_reason for c in whole.choices]
    assert order != sorted(order)  # the prompts ran side by side, not one after another
    assert (usage.prompt_tokens, usage.completion_tokens) == (whole.usage.prompt_tokens,
                                                              whole.usage.completion_tokens)


def test_a_batch_of_one_is_one_prompt(oa):
    client = oa.client()
    kw = dict(max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    one = client.completions.create(model=oa.model, prompt=["Hello"], **kw)
    assert one.choices[0].text == client.completions.create(model=oa.model, prompt="Hello", **kw).choices[0].text
    ids = _ids(7, 9)
    assert client.completions.create(model=oa.model, prompt=[ids], **kw).choices[0].text == \
        client.completions.create(model=oa.model, prompt=ids, **kw).choices[0].text


def _error(client: openai.OpenAI, model: str, **kw) -> tuple[int, dict]:
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(model=model, **kw)
    return e.value.status_code, e.value.response.json()["error"]


def test_caps_and_refusals_name_the_param(oa):
    client = oa.client()
    limits = oa.settings.limits
    status, err = _error(client, oa.model, prompt=["a"] * (limits.max_prompts + 1), max_tokens=1)
    assert status == 400 and err["param"] == "prompt" and f"at most {limits.max_prompts} prompts" in err["message"]
    status, err = _error(client, oa.model, prompt=["a"] * 5, n=64, max_tokens=1)
    assert status == 400 and err["param"] == "n" and str(limits.max_choices) in err["message"]
    status, err = _error(client, oa.model, prompt=["a", 7], max_tokens=1)
    assert status == 400 and err["param"] == "prompt"
    # One prompt too long for the context: 413, before anything ran.
    status, _ = _error(client, oa.model, prompt=[[5] * 10, [5] * 300], max_tokens=1)
    assert status == 413


def test_a_prompt_the_engine_refuses_fails_the_whole_request(oa):
    client = oa.client()
    before = len(oa.hooks.finished)
    status, err = _error(client, oa.model, prompt=[_ids(8, 1), [10**9], _ids(8, 2)], max_tokens=50,
                         extra_body={"ignore_eos": True})
    assert status == 400 and "token ids" in err["message"]
    assert wait_idle(oa.engine)  # the other prompts' requests were aborted
    assert len(oa.hooks.finished) == before + 1  # metered once, as one request


def test_a_client_leaving_a_prompt_list_stream_aborts_every_prompt(oa):
    body = {"model": oa.model, "prompt": [_ids(6, 4), _ids(6, 5), _ids(6, 6)], "max_tokens": 200,
            "ignore_eos": True, "stream": True}
    headers = {"authorization": f"Bearer {oa.keys['acme']}"}
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", f"{oa.url}/v1/completions", json=body, headers=headers) as r:
            assert r.status_code == 200
            rid = json.loads(next(r.iter_lines())[len("data: "):])["id"]
    deadline = time.monotonic() + 30
    while not (ended := [ctx for ctx in oa.hooks.finished if ctx.request_id == rid]):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert ended[0].finish_reason == "abort" and ended[0].num_output_tokens < 3 * 200
    assert wait_idle(oa.engine)
