"""DoRA and lora_bias adapters uploaded through the admin API serve PEFT's greedy tokens
through the OpenAI API, on SQLite and PostgreSQL."""
from __future__ import annotations

import pytest

from tests.e2e.admin_fixtures import adapter_files, admin_live  # noqa: F401 - fixtures
from tests.engine.oracle import hf_greedy

PROMPT = [1523, 9041, 312, 27003, 15, 889, 4410]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def kind_adapters(tmp_path_factory, tiny_llama_dir):
    from loraplex.adapters.synth import make_random_peft_adapter

    root = tmp_path_factory.mktemp("kind_uploads")
    return {kind: make_random_peft_adapter(tiny_llama_dir, root / kind, rank=8, seed=31 + i, init_scale=0.3,
                                           lora_config={flag: True})
            for i, (kind, flag) in enumerate((("dora", "use_dora"), ("bias", "lora_bias")))}


def test_uploaded_dora_and_lora_bias_adapters_generate_as_peft(admin_live, kind_adapters, tiny_llama_dir):  # noqa: F811
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    api = admin_live.client()
    tenant = f"kinds-{admin_live.backend}"
    names = []
    try:
        assert api.post("/tenants", json={"name": tenant}).status_code == 201
        client = admin_live.openai(api.post("/keys", json={"tenant": tenant}).json()["key"])
        for kind, folder in kind_adapters.items():
            name = f"{kind}-{admin_live.backend}"
            r = api.post("/adapters", data={"name": name, "grants": tenant}, files=adapter_files(folder))
            assert r.status_code == 201, r.text
            names.append(name)
            assert r.json()["rank"] == 8
            out = client.completions.create(model=name, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                            extra_body={"ignore_eos": True})
            ref = hf_greedy(tiny_llama_dir, [PROMPT], [MAX_TOKENS], adapter_dir=folder)[0]
            assert out.usage.completion_tokens == MAX_TOKENS
            assert out.choices[0].text == tokenizer.decode(ref, skip_special_tokens=True), kind
    finally:
        for name in names:
            api.delete(f"/adapters/{name}")
        api.close()
