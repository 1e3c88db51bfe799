"""DoRA, lora_bias and saved-module adapters (trainable tokens, saved norms) uploaded through
the admin API serve PEFT's greedy tokens through the OpenAI API, on SQLite and PostgreSQL,
and the API reports each one's kind; one too large for the server's upload limit is
refused with a message naming why."""
from __future__ import annotations

from tests.e2e.admin_fixtures import (KIND_PROMPT, adapter_files, admin_live, forget_kind,  # noqa: F401
                                      kind_adapters, upload_adapters)
from tests.engine.oracle import hf_greedy

MAX_TOKENS = 6
# The kinds of `kind_adapters` and of a plain upload, as the admin API reports them.
KINDS = {"plain": [], "dora": ["dora"], "bias": ["lora_bias"],
         "saved": ["trainable_tokens:embed_tokens", "modules_to_save:input_layernorm,post_attention_layernorm,norm"]}


def test_uploaded_adapters_report_their_kind(admin_live, kind_adapters, upload_adapters):  # noqa: F811
    """Upload, detail, listing, versions and the audit row carry the kind; a row from before
    kinds reads as unknown (null, which the schema allows) until its files come again."""
    api = admin_live.client()
    folders = {"plain": upload_adapters["r4"], **kind_adapters}
    names = {kind: f"kind-{kind}-{admin_live.backend}" for kind in folders}
    try:
        for kind, folder in folders.items():
            r = api.post("/adapters", data={"name": names[kind]}, files=adapter_files(folder))
            assert r.status_code == 201, r.text
            assert r.json()["features"] == r.json()["versions"][0]["features"] == KINDS[kind]
            assert api.audit("adapter.upload", f"adapter:{names[kind]}")[0]["details"]["features"] == KINDS[kind]
        listed = {a["name"]: a["features"] for a in api.get("/adapters").json()}
        assert {kind: listed[name] for kind, name in names.items()} == KINDS
        assert {kind: api.get(f"/adapters/{name}").json()["features"] for kind, name in names.items()} == KINDS

        forget_kind(admin_live, names["dora"])
        assert api.get(f"/adapters/{names['dora']}").json()["features"] is None
        assert {a["name"]: a["features"] for a in api.get("/adapters").json()}[names["dora"]] is None
        r = api.post(f"/adapters/{names['dora']}/versions", files=adapter_files(folders["dora"]))
        assert r.status_code == 200 and r.json()["features"] == ["dora"], r.text
        assert len(r.json()["versions"]) == 1  # the same version, its kind filled in
    finally:
        for name in names.values():
            api.delete(f"/adapters/{name}")
        api.close()


def test_uploaded_adapter_kinds_generate_as_peft(admin_live, kind_adapters, tiny_llama_dir):  # noqa: F811
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
            out = client.completions.create(model=name, prompt=KIND_PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                            extra_body={"ignore_eos": True})
            ref = hf_greedy(tiny_llama_dir, [KIND_PROMPT], [MAX_TOKENS], adapter_dir=folder)[0]
            assert out.usage.completion_tokens == MAX_TOKENS
            assert out.choices[0].text == tokenizer.decode(ref, skip_special_tokens=True), kind
    finally:
        for name in names:
            api.delete(f"/adapters/{name}")
        api.close()


def test_a_saved_lm_head_over_the_upload_limit_is_refused_naming_why(admin_live, tmp_path,  # noqa: F811
                                                                     tiny_llama_dir):
    """The tiny model's lm_head is 12.6 MB in float32, over this server's 4 MiB
    admin_max_upload_bytes (the store's own bound, which counts it, is larger)."""
    from loraplex.adapters.synth import make_random_peft_adapter

    folder = make_random_peft_adapter(tiny_llama_dir, tmp_path / "head", rank=4, target_modules=["q_proj"],
                                      lora_config={"modules_to_save": ["lm_head"]})
    api = admin_live.client()
    try:
        r = api.post("/adapters", data={"name": f"head-{admin_live.backend}"}, files=adapter_files(folder))
        assert r.status_code == 413, r.text
        assert "(admin_max_upload_bytes); an adapter that saves embed_tokens or lm_head" in r.text
        assert f"carries {4 * 49152 * 64} bytes" in r.text
    finally:
        api.close()
