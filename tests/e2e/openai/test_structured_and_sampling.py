"""The official openai client against a live server over the tiny Llama: JSON-schema
responses in a mixed batch, n choices from one prefill, best_of, echo with prompt
logprobs, penalties and logit_bias, and fields that are refused."""
from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from loraplex.engine.config import CacheConfig, EngineConfig, ModelConfig
from loraplex.engine.engine import LLMEngine
from loraplex.engine.request import SamplingParams
from tests.e2e.conftest import engine_stats
from tests.engine.structured.test_structured_engine import SCHEMAS

BLOCK = 16  # the e2e engine's KV block size


@pytest.fixture(scope="module")
def reference(tiny_llama_dir) -> LLMEngine:
    """A second engine on the same checkpoint, driven directly."""
    return LLMEngine(EngineConfig(model=ModelConfig(model=str(tiny_llama_dir), dtype="float32"),
                                  cache=CacheConfig(block_size=BLOCK, num_blocks=64), num_threads=1))


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


def _error(exc: openai.APIStatusError) -> dict:
    return exc.response.json()["error"]


def _loads(text: str):
    try:
        return json.loads(text)
    except ValueError:
        pytest.fail(f"not JSON: {text!r}")


def _schema_format(name: str) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name.replace("-", "_"), "schema": SCHEMAS[name],
                                                   "strict": True}}


def test_json_schema_in_a_mixed_batch_with_an_adapter(oa):
    client = oa.client("acme")
    free = [dict(model=m, prompt=_ids(12, i), max_tokens=16, temperature=t, seed=3,
                 extra_body={"ignore_eos": True})
            for i, (m, t) in enumerate([(oa.model, 0), ("pub", 0), (oa.model, 0.9), ("pub", 0.9)])]
    alone = [client.completions.create(**kw).choices[0].text for kw in free]
    constrained = [dict(model=m, messages=[{"role": "user", "content": f"Describe item {i}"}], max_tokens=120,
                        temperature=0.7, seed=i, response_format=_schema_format(name))
                   for i, (name, m) in enumerate((n, m) for n in sorted(SCHEMAS) for m in (oa.model, "pub"))]

    def run(job):
        kind, kw = job
        if kind == "free":
            return client.completions.create(**kw).choices[0]
        return client.chat.completions.create(**kw).choices[0]

    jobs = [("json", kw) for kw in constrained[:4]] + [("free", kw) for kw in free] + \
        [("json", kw) for kw in constrained[4:]]
    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(run, jobs))
    assert [r.text for r in results[4:8]] == alone  # constraints never leak into other rows
    for r, kw in zip(results[:4] + results[8:], constrained):
        assert r.finish_reason == "stop", r.message.content
        schema = kw["response_format"]["json_schema"]["schema"]
        jsonschema.validate(_loads(r.message.content), schema)


def test_json_object(oa):
    r = oa.client().chat.completions.create(model=oa.model, messages=[{"role": "user", "content": "JSON please"}],
                                            max_tokens=200, temperature=0, response_format={"type": "json_object"})
    text = r.choices[0].message.content
    assert text.lstrip().startswith("{")
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize("schema, param, words", [
    ({"type": "object", "properties": {"a": {"type": "string", "pattern": "(?<=a)b"}}}, None, ["Lookbehind"]),
    ({"type": "object", "properties": {"a": {"not": {"type": "null"}}}}, "response_format", ["'not'"]),
])
def test_unsupported_schemas_are_400_naming_the_feature(oa, schema, param, words):
    with pytest.raises(openai.BadRequestError) as e:
        oa.client().chat.completions.create(model=oa.model, messages=[{"role": "user", "content": "x"}],
                                            response_format={"type": "json_schema",
                                                             "json_schema": {"name": "s", "schema": schema}})
    err = _error(e.value)
    assert all(w in err["message"] for w in words)
    if param:
        assert err["param"] == param


@pytest.mark.parametrize("endpoint, extra, param", [
    ("chat", {"frobnicate": 1}, "frobnicate"),
    ("chat", {"functions": [{"name": "f"}]}, "functions"),
    ("chat", {"presence_penalty": 3}, "presence_penalty"),
    ("chat", {"logit_bias": {"99999999": 1}}, None),  # beyond the vocabulary: the engine says so
    ("completions", {"suffix": "return x"}, "suffix"),
    ("completions", {"best_of": 2, "n": 3}, "best_of"),
    ("completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
])
def test_unknown_and_unsupported_fields_are_refused(oa, endpoint, extra, param):
    client = oa.client()
    with pytest.raises(openai.BadRequestError) as e:
        if endpoint == "chat":
            client.chat.completions.create(model=oa.model, messages=[{"role": "user", "content": "x"}],
                                           max_tokens=2, extra_body=extra)
        else:
            client.completions.create(model=oa.model, prompt="x", max_tokens=2, extra_body=extra)
    err = _error(e.value)
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param if param else "logit_bias" in err["message"]


def test_harmless_fields_are_accepted(oa):
    r = oa.client().chat.completions.create(model=oa.model, messages=[{"role": "user", "content": "x"}],
                                            max_tokens=2, user="end-user-1", metadata={"k": "v"}, store=False)
    assert r.choices[0].message.content is not None


@pytest.mark.parametrize("extra", [
    {"presence_penalty": 1.5, "frequency_penalty": 1.0},
    {"repetition_penalty": 1.4},
    {"frequency_penalty": -1.5, "logit_bias": {"1012": 4.0, "284": -100}},
    {"min_p": 0.2, "temperature": 1.0, "seed": 9},
])
def test_penalties_and_bias_equal_the_engine_driven_directly(oa, reference, extra):
    prompt = _ids(20, 5)
    body = {"temperature": 0, **extra}
    r = oa.client().completions.create(model=oa.model, prompt=prompt, max_tokens=24, extra_body={
        "ignore_eos": True, **{k: v for k, v in body.items() if k not in ("temperature", "seed")}},
        temperature=body["temperature"], seed=body.get("seed"))
    sp = SamplingParams(max_tokens=24, ignore_eos=True, **body)
    assert r.choices[0].text == reference.generate([prompt], sp)[0].new_text
    plain = reference.generate([prompt], SamplingParams(max_tokens=24, ignore_eos=True, temperature=0))[0]
    if "min_p" not in extra:
        assert plain.new_text != r.choices[0].text  # the processors changed something


def test_logit_bias_forces_a_token(oa):
    token = 1012
    r = oa.client().completions.create(model=oa.model, prompt="Hello", max_tokens=5, temperature=0.8, seed=1,
                                       logit_bias={str(token): 100}, logprobs=0)
    tokens = r.choices[0].logprobs.tokens
    assert len(tokens) == 5 and len(set(tokens)) == 1


def test_n_choices_share_one_prefill(oa):
    client = oa.client()
    prompt = _ids(40, 11)
    before = engine_stats(oa.engine)
    kw = dict(model=oa.model, prompt=prompt, max_tokens=8, temperature=1.0, seed=7, n=4,
              extra_body={"ignore_eos": True})
    r = client.completions.create(**kw)
    after = engine_stats(oa.engine)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert len({c.text for c in r.choices}) == 4
    assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == 32
    metered = next(ctx for ctx in oa.hooks.finished if ctx.request_id == r.id)
    assert (metered.num_prompt_tokens, metered.num_output_tokens, metered.max_tokens) == (len(prompt), 32, 32)
    full = (len(prompt) - 1) // BLOCK * BLOCK
    assert after.prefix_cache_hits - before.prefix_cache_hits == 3 * full  # choices 1-3 reuse choice 0's blocks
    assert after.prefix_cache_queries - before.prefix_cache_queries == 4 * len(prompt)
    again = client.completions.create(**kw)
    assert [c.text for c in again.choices] == [c.text for c in r.choices]
    metrics = oa.client()._client.get(f"{oa.url}/metrics").text
    assert "vllm:prefix_cache_hits" in metrics


def test_n_choices_stream_with_their_index(oa):
    client = oa.client()
    kw = dict(model="pub", messages=[{"role": "user", "content": "Tell me"}], max_tokens=10, temperature=1.0,
              seed=21, n=3)
    whole = client.chat.completions.create(**kw)
    texts, reasons = {}, {}
    usage = None
    for chunk in client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    assert [texts[i] for i in range(3)] == [c.message.content for c in whole.choices]
    assert [reasons[i] for i in range(3)] == [c.finish_reason for c in whole.choices]
    assert usage.prompt_tokens == whole.usage.prompt_tokens
    assert usage.completion_tokens == whole.usage.completion_tokens


def test_best_of_keeps_the_most_likely(oa):
    client = oa.client()
    kw = dict(model=oa.model, prompt="Once upon a time", max_tokens=6, temperature=1.0, seed=4,
              extra_body={"ignore_eos": True})
    best = client.completions.create(**kw, best_of=3)
    assert len(best.choices) == 1 and best.choices[0].logprobs is None
    assert best.usage.completion_tokens == 18  # every generated choice is counted
    all3 = client.completions.create(**kw, n=3, logprobs=0)
    top = max(all3.choices, key=lambda c: sum(c.logprobs.token_logprobs))
    assert best.choices[0].text == top.text


def test_echo_with_prompt_logprobs(oa, reference):
    client = oa.client()
    prompt = "The capital of France is"
    kw = dict(model=oa.model, prompt=prompt, max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    plain = client.completions.create(**kw, logprobs=2)
    echoed = client.completions.create(**kw, logprobs=2, echo=True)
    ids = reference.tokenizer.encode(prompt)
    c = echoed.choices[0]
    assert c.text == prompt + plain.choices[0].text
    lp = c.logprobs
    assert len(lp.tokens) == len(ids) + 4 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[len(ids):] == plain.choices[0].logprobs.token_logprobs
    assert lp.text_offset[len(ids)] == len(prompt)
    ref = reference.generate([ids], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2))[0]
    assert lp.token_logprobs[1:len(ids)] == pytest.approx([p[0] for p in ref.prompt_logprobs[1:]], abs=1e-4)
    assert echoed.usage.prompt_tokens == len(ids) and echoed.usage.completion_tokens == 4
    streamed = "".join(ch.choices[0].text for ch in client.completions.create(**kw, echo=True, stream=True))
    assert streamed == c.text
