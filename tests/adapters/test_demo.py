"""The demo adapters: trained once per machine, cached atomically, valid, visibly effective."""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import torch

from loraplex.adapters import LORA_MODULES, AdapterStore, BaseShapes, load_peft_adapter
from loraplex.adapters import demo
from loraplex.adapters.demo import DEMO_NAMES, base_fingerprint, ensure_demo_adapters

# Chat questions the adapters were not trained on.
HELD_OUT = ["How can I improve my writing?", "Tell me about the ocean.", "What is the best way to cook pasta?"]


# ---- caching and locking, with a stand-in trainer (no model) ---------------------------

@pytest.fixture
def fake_base(tmp_path: Path) -> Path:
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    (base / "model.safetensors").write_bytes(b"\0" * 128)
    return base


@pytest.fixture
def fake_trainer(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    calls: list[str] = []

    def train(base_dir: Path, out_dir: Path, name: str) -> float:
        calls.append(name)
        time.sleep(0.2)  # long enough for concurrent callers to pile up on the lock
        (out_dir / "adapter_config.json").write_text("{}")
        (out_dir / "adapter_model.safetensors").write_bytes(b"x")
        return 0.0

    monkeypatch.setattr(demo, "train_demo_adapter", train)
    return calls


def test_concurrent_callers_train_each_adapter_once(fake_base, fake_trainer, tmp_path, capfd):
    results: list[dict[str, Path]] = []
    threads = [threading.Thread(target=lambda: results.append(ensure_demo_adapters(fake_base, tmp_path / "cache")))
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(fake_trainer) == sorted(DEMO_NAMES)
    assert len(results) == 4 and all(r == results[0] for r in results)
    folder = tmp_path / "cache" / "demo-adapters" / base_fingerprint(fake_base)
    assert set(results[0]) == set(DEMO_NAMES)
    assert all(p.parent == folder for p in results[0].values())
    assert not list(folder.glob(".*.tmp-*")), "a temp folder was left behind"
    err = capfd.readouterr().err
    assert all(f"training demo adapter {n!r}" in err for n in DEMO_NAMES)


def test_cache_dir_defaults_to_the_env_var(fake_base, fake_trainer, tmp_path, monkeypatch):
    monkeypatch.setenv("LORAPLEX_CACHE_DIR", str(tmp_path / "env-cache"))
    dirs = ensure_demo_adapters(fake_base)
    assert all(str(p).startswith(str(tmp_path / "env-cache" / "demo-adapters")) for p in dirs.values())


def test_failed_training_exposes_nothing(fake_base, tmp_path, monkeypatch):
    def broken(base_dir: Path, out_dir: Path, name: str) -> float:
        (out_dir / "adapter_config.json").write_text("{}")  # half-written, then a crash
        raise RuntimeError("out of memory")

    monkeypatch.setattr(demo, "train_demo_adapter", broken)
    with pytest.raises(RuntimeError):
        ensure_demo_adapters(fake_base, tmp_path)
    folder = tmp_path / "demo-adapters" / base_fingerprint(fake_base)
    assert [p.name for p in folder.iterdir() if not p.name.endswith(".lock")] == []


def test_fingerprint_follows_base_model(fake_base):
    before = base_fingerprint(fake_base)
    assert base_fingerprint(fake_base) == before
    (fake_base / "model.safetensors").write_bytes(b"\0" * 256)
    resized = base_fingerprint(fake_base)
    (fake_base / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 128}))
    assert len({before, resized, base_fingerprint(fake_base)}) == 3


# ---- the real adapters on SmolLM2 -------------------------------------------------------

@pytest.fixture(scope="module")
def demo_dirs(smollm2_dir: Path) -> dict[str, Path]:
    # The default cache dir: trained once per machine (~1-2 min each on 2 idle cores).
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # this package's conftest pins 1 thread for its tiny models
    try:
        return ensure_demo_adapters(smollm2_dir)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.slow
def test_demo_adapters_are_valid_peft_folders(demo_dirs, smollm2_dir, tmp_path):
    assert set(demo_dirs) == {"pirate", "terse"}
    base = BaseShapes.from_model_dir(smollm2_dir)
    store = AdapterStore(tmp_path / "store", base)
    for name, path in demo_dirs.items():
        adapter = load_peft_adapter(path, base)
        assert adapter.rank == 8
        assert adapter.target_modules == LORA_MODULES
        assert len(adapter.weights) == base.num_layers * len(LORA_MODULES)
        assert any(float(w.b.abs().max()) > 0 for w in adapter.weights.values()), "lora_B is still zero: untrained"
        assert store.add(name, path).digest == adapter.digest


@pytest.mark.slow
def test_second_call_uses_the_cache(demo_dirs, smollm2_dir, monkeypatch, capfd):
    stamps = {p: p.stat().st_mtime_ns for d in demo_dirs.values() for p in d.iterdir()}

    def must_not_train(*args, **kwargs):
        raise AssertionError("the cached demo adapters were trained again")

    monkeypatch.setattr(demo, "train_demo_adapter", must_not_train)
    capfd.readouterr()
    start = time.perf_counter()
    again = ensure_demo_adapters(smollm2_dir)
    elapsed = time.perf_counter() - start
    assert again == demo_dirs
    assert {p: p.stat().st_mtime_ns for d in again.values() for p in d.iterdir()} == stamps
    assert "training" not in capfd.readouterr().err
    print(f"cached ensure_demo_adapters: {elapsed * 1e3:.1f} ms")


def _chat_greedy(model, tokenizer, question: str, max_tokens: int = 40) -> str:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)["input_ids"]
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()


@pytest.mark.slow
def test_each_adapter_visibly_changes_greedy_output(demo_dirs, smollm2_dir):
    """transformers + PEFT (the reference) on chat questions the adapters never saw."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
        model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
        with torch.inference_mode():
            base = [_chat_greedy(model, tokenizer, q) for q in HELD_OUT]
            out = {}
            for name, path in demo_dirs.items():
                peft_model = PeftModel.from_pretrained(model, path).eval()
                out[name] = [_chat_greedy(peft_model, tokenizer, q) for q in HELD_OUT]
                model = peft_model.unload()  # the plain base model again, for the next adapter
    finally:
        torch.set_num_threads(threads)
    for q, b, p, t in zip(HELD_OUT, base, out["pirate"], out["terse"]):
        print(f"{q}\n  base:   {b!r}\n  pirate: {p!r}\n  terse:  {t!r}")
    assert not any("arr" in b.lower().split(",")[0] for b in base)
    assert all(p.lower().startswith("arr") for p in out["pirate"]), out["pirate"]
    # Terse: a few words and done (the base model rambles past the 40-token cap).
    assert all(len(t.split()) <= 6 for t in out["terse"]), out["terse"]
    assert all(len(b.split()) > 15 for b in base), base
