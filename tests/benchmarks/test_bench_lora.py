"""bench_lora's adapter generator and scenarios, and one quick real run end to end."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import bench_lora as bl
from loraplex.adapters import AdapterStore, BaseShapes

ROOT = Path(__file__).resolve().parents[2]


def test_generated_adapters_are_valid_peft_of_their_ranks(tiny_llama_dir, tmp_path):
    dirs = bl.make_adapters(tiny_llama_dir, tmp_path / "gen", 5, (8, 16, 64), ("q_proj", "v_proj"))
    store = AdapterStore(tmp_path / "store", BaseShapes.from_model_dir(tiny_llama_dir))
    records = [store.add(d.name, d) for d in dirs]
    assert [r.rank for r in records] == [8, 16, 64, 8, 16]
    assert len({r.digest for r in records}) == 5, "every adapter has content of its own"
    assert all(set(r.target_modules) == {"q_proj", "v_proj"} for r in records)


@pytest.mark.parametrize("kind", ["dora", "lora_bias", "tokens", "saved_norm"])
def test_generated_kind_adapters_are_valid_peft_of_their_kind(tiny_llama_dir, tmp_path, kind):
    from loraplex.adapters import load_peft_adapter

    dirs = bl.make_adapters(tiny_llama_dir, tmp_path / "gen", 2, (8,), bl.ALL_MODULES, kind=kind)
    base = BaseShapes.from_model_dir(tiny_llama_dir)
    adapters = [load_peft_adapter(d, base) for d in dirs]
    assert adapters[0].digest != adapters[1].digest
    for a in adapters:
        assert len(a.weights) == 2 * 7 and a.rank == 8
        w = a.weights[(0, "q_proj")]
        assert (w.magnitude is not None, w.bias is not None) == (kind == "dora", kind == "lora_bias")
        saved = a.saved
        assert (saved is not None and saved.embed_rows is not None) == (kind == "tokens")
        assert (saved is not None and saved.final_norm is not None and len(saved.norms) == 2 * 2) == (
            kind == "saved_norm")
    if kind == "tokens":
        assert adapters[0].saved.embed_rows.ids.tolist() == bl.TRAINED_TOKENS
        assert not adapters[1].saved.embed_rows.rows.equal(adapters[0].saved.embed_rows.rows)


def test_scenarios_parse_and_refuse_nonsense():
    assert bl.parse_scenarios("32:uniform,1000:mixed") == [(32, "uniform"), (1000, "mixed")]
    for bad in ("32", "0:zipf", "x:uniform", "8:popular"):
        with pytest.raises(SystemExit):
            bl.parse_scenarios(bad)


def test_quick_run_prints_ratios_against_the_base_model(tmp_path):
    out = tmp_path / "summary.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(ROOT)) if p))
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_lora.py"), "--quick", "--threads", "1",
                           "--kinds", "2", "--kind-rounds", "1", "--workdir", str(tmp_path / "work"), "--json", str(out)],
                          env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    kinds = ["base", "plain", "dora", "lora_bias", "tokens", "saved_norm", "mixture"]
    assert [r["config"].split()[0:2] for r in rows] == [["base", "model"], ["3", "adapters,"], ["5", "adapters,"]] + [
        ["2", "rank-8"]] * len(kinds)
    assert [r["config"].split()[-1] for r in rows[3:]] == kinds
    assert rows[4]["step_vs_plain"] == 1.0 and all(r["step_vs_plain"] > 0 and r["step_ms"] > 0 for r in rows[3:])
    assert rows[-1]["step_vs_parts"] > 0
    assert "x plain LoRA's" in proc.stdout and "x its parts" in proc.stdout
    assert rows[0]["tok_s_ratio"] == 1.0 and rows[0]["ttft_p50_ratio"] == 1.0
    for r in rows[:3]:
        assert r["tok_s"] > 0 and r["ttft_p50"] > 0
    assert "x base" in proc.stdout and "TTFT p50" in proc.stdout
