"""vLLM's /tokenize and /detokenize over HTTP, as vLLM's clients call them: counts equal
the prompt tokens a completion reports, tenant keys and adapter routing hold, and bad
input is a 400 naming the field."""
from __future__ import annotations

import httpx
import pytest

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]


def _post(oa, path: str, body: dict, tenant: str | None = "acme") -> httpx.Response:
    headers = {"authorization": f"Bearer {oa.keys[tenant]}"} if tenant else {}
    return httpx.post(f"{oa.url}{path}", json=body, headers=headers, timeout=60)


def test_a_prompt_counts_as_a_completion_does(oa):
    text = "The quick brown fox jumps over the lazy dog"
    r = _post(oa, "/tokenize", {"model": oa.model, "prompt": text, "return_token_strs": True})
    assert r.status_code == 200, r.text
    doc = r.json()
    ids = oa.engine.tokenizer.encode(text)
    assert doc["tokens"] == ids and doc["count"] == len(ids) and doc["max_model_len"] == oa.engine.max_model_len
    assert doc["token_strs"] == oa.engine.tokenizer.hf.convert_ids_to_tokens(ids)
    usage = oa.client().completions.create(model=oa.model, prompt=text, max_tokens=1).usage
    assert usage.prompt_tokens == doc["count"]
    plain = _post(oa, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()
    assert plain["tokens"] == oa.engine.tokenizer.encode(text, add_special_tokens=False)
    assert plain["token_strs"] is None


def test_messages_count_as_a_chat_completion_does(oa):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the weather?"}]
    for extra in ({}, {"tools": TOOLS}):
        doc = _post(oa, "/tokenize", {"model": "pub", "messages": messages, **extra}).json()
        usage = oa.client().chat.completions.create(model="pub", messages=messages, max_tokens=1, **extra).usage
        assert doc["count"] == usage.prompt_tokens == len(doc["tokens"])
    bare = _post(oa, "/tokenize", {"messages": messages, "add_generation_prompt": False}).json()
    with_prompt = _post(oa, "/tokenize", {"messages": messages}).json()
    assert bare["count"] < with_prompt["count"] and with_prompt["tokens"][:bare["count"]] == bare["tokens"]


def test_detokenize_round_trips(oa):
    text = "Hello, world! <|im_end|>"
    ids = _post(oa, "/tokenize", {"prompt": text}).json()["tokens"]
    r = _post(oa, "/detokenize", {"model": oa.model, "tokens": ids})
    assert r.status_code == 200 and r.json() == {"prompt": text}


def test_keys_and_adapters_are_checked(oa):
    assert _post(oa, "/tokenize", {"prompt": "x"}, tenant=None).status_code == 401
    assert _post(oa, "/detokenize", {"tokens": [1]}, tenant=None).status_code == 401
    # acme may use acme-private; beta may not, and learns no more than for an unknown name.
    assert _post(oa, "/tokenize", {"model": "acme-private", "prompt": "x"}).status_code == 200
    hidden = _post(oa, "/tokenize", {"model": "acme-private", "prompt": "x"}, tenant="beta")
    unknown = _post(oa, "/tokenize", {"model": "nope", "prompt": "x"}, tenant="beta")
    assert hidden.status_code == unknown.status_code == 404
    assert _post(oa, "/adapters/pub/tokenize", {"prompt": "x"}, tenant="beta").status_code == 200
    assert _post(oa, "/adapters/acme-private/detokenize", {"tokens": [1]}, tenant="beta").status_code == 404
    assert _post(oa, "/adapters/acme-private/detokenize", {"tokens": [1]}).status_code == 200


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {"prompt": "x", "frobnicate": 1}, "frobnicate"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ 1 }}"}, "chat_template"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "continue_final_message": True},
     "continue_final_message"),
    ("/tokenize", {"prompt": ["a", "b"]}, "prompt"),
    ("/tokenize", {"prompt": "x", "return_token_strs": "yes"}, "return_token_strs"),
    ("/detokenize", {"tokens": [1, 10**9]}, "tokens"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
    ("/detokenize", {"tokens": [1] * 100_000}, "tokens"),
])
def test_bad_input_is_a_400_naming_the_field(oa, path, body, param):
    r = _post(oa, path, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_text_that_cannot_fit_is_refused_before_tokenizing(oa):
    r = _post(oa, "/tokenize", {"prompt": "x" * (oa.engine.max_model_len * oa.engine.tokenizer.max_token_chars * 5)})
    assert r.status_code == 413


def test_tokenizer_info(oa):
    r = httpx.get(f"{oa.url}/tokenizer_info", headers={"authorization": f"Bearer {oa.keys['acme']}"}, timeout=30)
    assert r.status_code == 200
    info, hf = r.json(), oa.engine.tokenizer.hf
    assert (info["eos_token"], info["tokenizer_class"]) == (hf.eos_token, type(hf).__name__)
    assert info["chat_template"] == oa.engine.tokenizer.chat_template
    assert httpx.get(f"{oa.url}/tokenizer_info", timeout=30).status_code == 401
