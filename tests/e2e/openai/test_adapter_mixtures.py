"""Adapter mixtures through the OpenAI API, with the official openai client: the `adapters`
extension and the URL form serve PEFT's cat combination of the tenant's adapters; metering
records the mixture; what the tenant may not use, or a malformed mixture, is refused."""
from __future__ import annotations

import openai
import pytest

from loraplex.engine.mixtures import mixture_ref
from loraplex.engine.request import AdapterRef
from loraplex.platform.metering.hooks import event_of
from tests.engine.oracle import hf_greedy_mixture

PROMPT = [1523, 9041, 312, 27003, 15, 889, 4410]
MAX_TOKENS = 6
MIX = "acme-private*0.7+pub*-0.4"  # canonical: sorted by name
ADAPTERS = [{"name": "pub", "weight": -0.4}, {"name": "acme-private", "weight": 0.7}]


def _greedy(**extra) -> dict:
    body = {"ignore_eos": True, **extra.pop("extra_body", {})}
    return dict(prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, extra_body=body, **extra)


@pytest.fixture(scope="module")
def expected(tiny_llama_dir, tiny_adapters) -> str:
    from transformers import AutoTokenizer

    dirs = {"acme-private": tiny_adapters["ad1"], "pub": tiny_adapters["ad3"]}
    ref = hf_greedy_mixture(tiny_llama_dir, [PROMPT], [MAX_TOKENS], dirs, {"acme-private": 0.7, "pub": -0.4})[0]
    return AutoTokenizer.from_pretrained(str(tiny_llama_dir)).decode(ref, skip_special_tokens=True)


def test_the_adapters_field_serves_the_mixture_and_meters_it(oa, expected):
    before = len(oa.hooks.finished)
    out = oa.client("acme").completions.create(model=oa.model, **_greedy(extra_body={"adapters": ADAPTERS}))
    assert out.model == MIX and out.usage.completion_tokens == MAX_TOKENS
    assert out.choices[0].text == expected
    alone = oa.client("acme").completions.create(model="acme-private", **_greedy())
    assert alone.choices[0].text != expected  # the mixture is not its first component
    ctx = oa.hooks.finished[before]
    gw = oa.gateway
    want = mixture_ref([(gw.adapter_ref("acme-private"), 0.7), (gw.adapter_ref("pub"), -0.4)])
    event = event_of(ctx)
    assert (event.adapter, event.adapter_digest) == (MIX, want.digest)


def test_the_url_form_and_chat(oa, expected):
    by_url = oa.client("acme", base="/adapters/pub*-0.4+acme-private*0.70/v1").completions.create(
        model="", **_greedy())
    assert by_url.model == MIX and by_url.choices[0].text == expected
    chat = oa.client("acme").chat.completions.create(
        model=oa.model, messages=[{"role": "user", "content": "hi"}], max_tokens=3, temperature=0,
        extra_body={"adapters": ADAPTERS, "ignore_eos": True})
    assert chat.model == MIX and chat.usage.completion_tokens == 3


@pytest.mark.parametrize("tenant, extra, error", [
    ("beta", {"adapters": ADAPTERS}, openai.NotFoundError),  # acme-private is not beta's
    ("acme", {"adapters": [{"name": "pub", "weight": 1}, {"name": "ghost", "weight": 1}]}, openai.NotFoundError),
    ("acme", {"adapters": [{"name": "pub", "weight": 0}]}, openai.BadRequestError),
    ("acme", {"adapters": [{"name": "pub", "weight": "high"}]}, openai.BadRequestError),
    ("acme", {"adapters": [{"name": f"a{i}", "weight": 1} for i in range(5)]}, openai.BadRequestError),
    ("acme", {"adapters": {"pub": 1}}, openai.BadRequestError),
])
def test_refusals(oa, tenant, extra, error):
    with pytest.raises(error) as exc:
        oa.client(tenant).completions.create(model=oa.model, **_greedy(extra_body=extra))
    if error is openai.BadRequestError:
        assert exc.value.body["param"] == "adapters"


def test_adapters_with_an_adapter_in_model_is_refused(oa):
    with pytest.raises(openai.BadRequestError, match="adapters names the adapters to mix"):
        oa.client("acme").completions.create(model="pub", **_greedy(extra_body={"adapters": ADAPTERS}))
    with pytest.raises(openai.BadRequestError, match="name\\*weight"):
        oa.client("acme", base="/adapters/pub*/v1").completions.create(model="", **_greedy())


def test_a_mixture_ref_differs_from_its_components(oa):
    gw = oa.gateway
    pub = gw.adapter_ref("pub")
    assert isinstance(pub, AdapterRef) and gw.adapter_ref("pub*1.0").digest != pub.digest
