"""The GPU serving path's wiring, proven on a machine without a GPU.

`loraplex serve --kernels triton` runs every Triton kernel (KV write, paged attention,
multi-LoRA) through Triton's interpreter on CPU tensors: OpenAI requests for the base
model and two adapters, batched together, give the torch path's greedy text. The CLI's
device options resolve (auto -> the CPU here; cuda -> a clear refusal, exit 2), and a KV
pool that cannot hold one max-length sequence is refused with its figures (exit 2).
"""
from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from loraplex.adapters import AdapterStore, BaseShapes
from loraplex.engine.config import CacheConfig, EngineConfig, LoRAConfig, ModelConfig
from loraplex.engine.engine import LLMEngine
from loraplex.engine.lora import LoRAManager
from loraplex.engine.request import SamplingParams
from loraplex.platform.cli.main import build_parser, engine_config_from_args
from tests.e2e.test_serve_cli import Serve
from tests.platform.fixtures import run_cli

MAX_MODEL_LEN, NUM_BLOCKS, MAX_TOKENS = 256, 64, 6
PROMPT = "The capital of France is"
ADAPTERS = (None, "ad1", "ad2")  # None: the base model
CLI = [sys.executable, "-c", "from loraplex.platform.cli.main import main; main()"]


def _torch_reference(model_dir, store_root, adapters) -> dict[str | None, str]:
    store = AdapterStore(store_root, BaseShapes.from_model_dir(model_dir))
    for name in ("ad1", "ad2"):
        store.add(name, adapters[name])
    cfg = EngineConfig(model=ModelConfig(model=str(model_dir), dtype="float32", max_model_len=MAX_MODEL_LEN),
                       cache=CacheConfig(num_blocks=NUM_BLOCKS), lora=LoRAConfig(max_lora_rank=64), kernels="torch")
    engine = LLMEngine(cfg, LoRAManager(store, cfg.lora))
    try:
        greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
        return {a: engine.generate([PROMPT], greedy, adapter=a)[0].new_text for a in ADAPTERS}
    finally:
        engine.lora.close()


def test_serve_with_triton_kernels_equals_the_torch_path(capsys, tmp_path, tiny_llama_dir, tiny_adapters):
    want = _torch_reference(tiny_llama_dir, tmp_path / "ref", tiny_adapters)
    assert len(set(want.values())) == 3 and all(want.values())  # each adapter changes the text
    db = ["--database-url", f"sqlite:///{tmp_path / 'db.sqlite'}", "--data-dir", str(tmp_path / "data")]
    assert run_cli(capsys, "tenant", "create", "acme", *db)[0] == 0
    code, key, _ = run_cli(capsys, "key", "create", "acme", *db)
    assert code == 0
    env = {**os.environ, "TRITON_INTERPRET": "1"}  # before any kernel module is imported in the server
    serve = Serve("--model", str(tiny_llama_dir), *db, "--no-demo", "--device", "auto", "--kernels", "triton",
                  "--dtype", "float32", "--threads", "1", "--max-model-len", str(MAX_MODEL_LEN),
                  "--num-kv-blocks", str(NUM_BLOCKS), "--max-num-seqs", "4",
                  "--adapter", f"ad1={tiny_adapters['ad1']}", "--adapter", f"ad2={tiny_adapters['ad2']}", env=env)
    try:
        serve.wait_ready(timeout=300)
        log = "".join(serve.lines)
        assert "on cpu; triton kernels" in log, log  # --device auto chose the CPU, the Triton backend runs
        url = f"http://127.0.0.1:{serve.port}"
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=key.strip(), max_retries=0, timeout=600)

        def complete(adapter: str | None) -> str:
            r = client.completions.create(model=adapter or tiny_llama_dir.name, prompt=PROMPT,
                                          max_tokens=MAX_TOKENS, temperature=0)
            return r.choices[0].text

        with ThreadPoolExecutor(len(ADAPTERS)) as pool:  # base and both adapters share the batches
            got = dict(zip(ADAPTERS, pool.map(complete, ADAPTERS)))
        assert got == want
        samples = {s.name: s.value for fam in text_string_to_metric_families(
            httpx.get(f"http://127.0.0.1:{serve.metrics_port}/metrics").text)
                   for s in fam.samples}
        assert samples["vllm:gpu_cache_usage_perc"] == samples["vllm:kv_cache_usage_perc"]
    finally:
        assert serve.stop() == 0


def _engine_config(*argv: str) -> EngineConfig:
    return engine_config_from_args(build_parser().parse_args(["serve", *argv]))


def test_device_options_build_the_engine_config():
    cfg = _engine_config()
    assert cfg.model.device == ("cuda" if torch.cuda.is_available() else "cpu")  # auto
    assert (cfg.kernels, cfg.enforce_eager, cfg.model.dtype) == ("auto", False, "bfloat16")
    assert (cfg.cache.gpu_memory_utilization, cfg.cache.kv_cache_memory_bytes) == (0.9, None)
    cfg = _engine_config("--device", "cpu", "--gpu-memory-utilization", "0.75", "--enforce-eager",
                         "--kv-cache-memory", "2GiB", "--kernels", "triton")
    assert (cfg.model.device, cfg.kernels, cfg.enforce_eager) == ("cpu", "triton", True)
    assert (cfg.cache.gpu_memory_utilization, cfg.cache.kv_cache_memory_bytes) == (0.75, 2 << 30)


@pytest.mark.parametrize("value", ["0", "1.5", "most"])
def test_a_utilization_outside_zero_to_one_is_a_usage_error(capsys, value):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["serve", "--gpu-memory-utilization", value])
    assert e.value.code == 2 and "not a fraction in (0, 1]" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU")
def test_cuda_without_a_gpu_is_refused_clearly(tmp_path):
    r = subprocess.run([*CLI, "serve", "--device", "cuda", "--data-dir", str(tmp_path)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("loraplex: error: device 'cuda' asked for, but "), r.stderr
    assert "--device cpu" in r.stderr and "Traceback" not in r.stderr + r.stdout


def test_an_unknown_device_is_refused(capsys, tmp_path):
    code, _, err = run_cli(capsys, "serve", "--device", "gpu0", "--data-dir", str(tmp_path))
    assert code == 2 and "unknown device 'gpu0': use auto, cpu, cuda or cuda:N" in err


def test_a_kv_pool_below_one_max_length_sequence_is_refused(capsys, tmp_path, tiny_llama_dir):
    code, _, err = run_cli(capsys, "serve", "--model", str(tiny_llama_dir), "--device", "cpu", "--dtype", "float32",
                           "--kv-cache-memory", "256KiB", "--no-demo", "--threads", "1", "--data-dir", str(tmp_path),
                           "--database-url", f"sqlite:///{tmp_path / 'db.sqlite'}")
    assert code == 2
    assert ("loraplex: error: kv_cache_memory 0.25 MiB: 32 blocks, but one 2048-token sequence needs 128 KV blocks "
            "of 8192 bytes (1.00 MiB)") in err, err
