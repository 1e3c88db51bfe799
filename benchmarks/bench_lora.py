"""Multi-LoRA throughput: the base model alone vs 1, 8, 32, 128 distinct adapters vs transformers + PEFT.

One run, same seeded heavy-tailed workload (benchmarks/workload.py), same model, same threads:
  * loraplex serving the workload with the base model alone (the baseline),
  * loraplex serving it with N distinct adapters, requests assigned to adapters with
    uniform popularity (round-robin over a seeded shuffle: every adapter gets its share)
    or power-law popularity (Zipf, s=1.1: a few hot adapters, a long tail),
  * transformers + PEFT serving the same requests:
      grouped: requests grouped by adapter, one `load_adapter`/`set_adapter` per adapter,
               left-padded batched `generate` per group (what a simple PEFT server does);
      mixed:   every adapter loaded into one PeftModel, batches in arrival order with
               PEFT's per-row `adapter_names` (PEFT's own mixed-batch inference).
Prints output tokens/s for each, the ratio to the base model and to transformers + PEFT.

Adapters are rank 8 on all seven projections. One is made by PEFT itself
(make_random_peft_adapter); the rest copy its adapter_config.json and tensor names and
shapes with fresh seeded random values (PEFT would take seconds per adapter to build a
135M model each time), and every one is validated by AdapterStore.add.

LoRAConfig(max_loras=max(32, n), max_cpu_loras=max(64, n)): a server is configured for its
working set, so every adapter of the run has a device slot and stays in the CPU tier once
loaded. What is measured is the cost of batched LoRA compute over many adapters in one
step, not slot thrashing or re-reading adapters from disk (the oracle tests cover
rotation). The floors 32 / 64 are the sizes a deployment would run with anyway. Before
each timed run, every adapter it uses serves one 1-token request (loading it from disk
into the CPU tier and a slot), like the base model's own warm-up; that time is printed
separately.

On a 2-core machine that other processes keep busy, 2 torch threads can be several times
slower than 1 (and erratic): an OpenMP barrier waits for a thread that is not running.
There, use --threads 1, and --repeat-base to see whether the machine drifted during the run.

    python benchmarks/bench_lora.py                       # SmolLM2, 64 prompts, bf16, 2 threads
    python benchmarks/bench_lora.py --threads 1 --hf-prompts 16 --hf-modes grouped --repeat-base
    python benchmarks/bench_lora.py --num-prompts 16 --adapters 1,8 --hf-prompts 8
"""
from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workload import Workload, heavy_tailed, left_padded  # noqa: E402

from loraplex.adapters import AdapterStore, BaseShapes  # noqa: E402
from loraplex.adapters.synth import make_random_peft_adapter  # noqa: E402
from loraplex.engine.config import EngineConfig, LoRAConfig, ModelConfig, SchedulerConfig  # noqa: E402
from loraplex.engine.engine import LLMEngine  # noqa: E402
from loraplex.engine.loader import resolve_model_dir  # noqa: E402
from loraplex.engine.lora import LoRAManager  # noqa: E402
from loraplex.engine.request import SamplingParams  # noqa: E402


def make_adapters(model_dir: Path, root: Path, n: int, rank: int, seed: int = 0) -> list[Path]:
    """n valid PEFT folders: PEFT writes the first, the rest reuse its config and layout."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    template = make_random_peft_adapter(model_dir, root / "lora-000", rank=rank, alpha=2 * rank, seed=seed,
                                        init_scale=0.01)
    config = (template / "adapter_config.json").read_bytes()
    with safe_open(str(template / "adapter_model.safetensors"), framework="pt") as f:
        layout = {k: (f.get_slice(k).get_shape(), f.get_slice(k).get_dtype()) for k in f.keys()}
    assert all(dtype == "F32" for _, dtype in layout.values()), "PEFT saved a dtype this generator does not write"
    gen = torch.Generator().manual_seed(seed + 1)
    dirs = [template]
    for i in range(1, n):
        d = root / f"lora-{i:03d}"
        d.mkdir()
        (d / "adapter_config.json").write_bytes(config)
        tensors = {k: torch.randn(shape, generator=gen) * 0.01 for k, (shape, _) in sorted(layout.items())}
        save_file(tensors, str(d / "adapter_model.safetensors"), metadata={"format": "pt"})
        dirs.append(d)
    return dirs


def assign_adapters(num_requests: int, n: int, popularity: str, s: float, seed: int = 0) -> list[int]:
    """Adapter index per request."""
    rng = random.Random(seed)
    if popularity == "uniform":
        order = list(range(n))
        rng.shuffle(order)
        return [order[i % n] for i in range(num_requests)]
    weights = [1 / (k + 1) ** s for k in range(n)]  # adapter 0 is the hottest
    return rng.choices(range(n), weights=weights, k=num_requests)


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def run_engine(engine: LLMEngine, wl: Workload, adapters: list[str | None]) -> dict:
    """All requests arrive at once. Warm-up first: every batch width (LLMEngine.warm_up),
    the base model, then each adapter once."""
    engine.warm_up()
    engine.generate([wl.prompts[0][:8]], _greedy(2))
    start = time.perf_counter()
    for name in dict.fromkeys(a for a in adapters if a is not None):
        engine.add_request(wl.prompts[0][:8], _greedy(1), adapter=name)
    while engine.has_unfinished_requests():
        if not engine.step():
            time.sleep(0.005)  # adapters load in a background thread: do not spin on the GIL
    warm = time.perf_counter() - start
    steps = 0
    start = time.perf_counter()
    for p, n, a in zip(wl.prompts, wl.max_tokens, adapters):
        engine.add_request(p, _greedy(n), adapter=a)
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    elapsed = time.perf_counter() - start
    return {"tok_s": wl.num_output_tokens / elapsed, "elapsed": elapsed, "warm": warm, "steps": steps,
            "preemptions": engine.scheduler.num_preemptions}


def _hf_generate(model, prompts: list[list[int]], outs: list[int], **kw) -> None:
    ids, mask = left_padded(prompts)
    # Each batch runs to its longest request (min_new_tokens: like ignore_eos).
    model.generate(ids, attention_mask=mask, max_new_tokens=max(outs), min_new_tokens=max(outs),
                   do_sample=False, pad_token_id=0, **kw)


def run_hf(model_dir: Path, wl: Workload, adapters: list[Path | None], dtype: torch.dtype, batch: int,
           mode: str) -> dict:
    """transformers (+ PEFT) serving the same requests; adapter loading is inside the timing."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    model.generation_config.eos_token_id = None
    reqs = list(zip(wl.prompts, wl.max_tokens, adapters))
    load = 0.0
    start = time.perf_counter()
    with torch.inference_mode():
        if all(a is None for a in adapters):
            for b in range(0, len(reqs), batch):
                _hf_generate(model, [r[0] for r in reqs[b:b + batch]], [r[1] for r in reqs[b:b + batch]])
        elif mode == "grouped":
            from peft import PeftModel

            groups: dict[Path, list] = {}
            for r in reqs:
                groups.setdefault(r[2], []).append(r)
            peft_model = None
            for i, (path, group) in enumerate(groups.items()):
                t = time.perf_counter()
                if peft_model is None:
                    peft_model = PeftModel.from_pretrained(model, path, adapter_name="g0").eval()
                else:
                    peft_model.load_adapter(path, adapter_name=f"g{i}")
                    peft_model.set_adapter(f"g{i}")
                    peft_model.delete_adapter(f"g{i - 1}")  # only the current adapter stays in memory
                load += time.perf_counter() - t
                for b in range(0, len(group), batch):
                    _hf_generate(peft_model, [r[0] for r in group[b:b + batch]], [r[1] for r in group[b:b + batch]])
        else:  # mixed
            from peft import PeftModel

            names = {p: f"a{i}" for i, p in enumerate(dict.fromkeys(adapters))}
            t = time.perf_counter()
            first, *rest = names
            peft_model = PeftModel.from_pretrained(model, first, adapter_name=names[first]).eval()
            for p in rest:
                peft_model.load_adapter(p, adapter_name=names[p])
            load = time.perf_counter() - t
            for b in range(0, len(reqs), batch):
                chunk = reqs[b:b + batch]
                _hf_generate(peft_model, [r[0] for r in chunk], [r[1] for r in chunk],
                             adapter_names=[names[r[2]] for r in chunk])
    elapsed = time.perf_counter() - start
    return {"tok_s": wl.num_output_tokens / elapsed, "elapsed": elapsed, "load": load}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--adapters", default="1,8,32,128", help="distinct adapter counts, comma-separated")
    ap.add_argument("--popularity", default="uniform,zipf")
    ap.add_argument("--zipf-s", type=float, default=1.1)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=1024)
    ap.add_argument("--hf-prompts", type=int, default=None,
                    help="serve only the first N requests with transformers + PEFT (its tok/s is on those)")
    ap.add_argument("--hf-batch", type=int, default=16)
    ap.add_argument("--hf-modes", default="grouped,mixed", help="grouped and/or mixed (see above)")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--repeat-base", action="store_true", help="measure the base model again at the end (drift)")
    ap.add_argument("--workdir", default=None, help="where adapters are written (default: a temp dir, removed)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    counts = [int(x) for x in args.adapters.split(",")]
    pops = args.popularity.split(",")
    modes = [] if args.skip_hf else args.hf_modes.split(",")
    wl = heavy_tailed(args.num_prompts)
    hf_n = min(args.hf_prompts or len(wl.prompts), len(wl.prompts))
    hf_wl = Workload(wl.prompts[:hf_n], wl.max_tokens[:hf_n])
    model_dir = resolve_model_dir(args.model)
    dtype = getattr(torch, args.dtype)
    print(f"workload: {len(wl.prompts)} prompts, mean {sum(map(len, wl.prompts)) / len(wl.prompts):.0f} tokens; "
          f"{wl.num_output_tokens} output tokens ({min(wl.max_tokens)}-{max(wl.max_tokens)}, ignore_eos, greedy); "
          f"{args.dtype}, {args.threads} threads; adapters rank {args.rank} on all 7 projections; "
          f"transformers + PEFT on {hf_n} of the requests ({hf_wl.num_output_tokens} output tokens)", flush=True)

    tmp = Path(args.workdir or tempfile.mkdtemp(prefix="bench-lora-"))
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        t = time.perf_counter()
        dirs = make_adapters(model_dir, tmp / "peft", max(counts), args.rank)
        made = time.perf_counter() - t
        store = AdapterStore(tmp / "store", BaseShapes.from_model_dir(model_dir))
        t = time.perf_counter()
        names = [store.add(d.name, d).name for d in dirs]
        size = sum(f.stat().st_size for f in (tmp / "peft").rglob("*") if f.is_file())
        print(f"{len(dirs)} adapters: made in {made:.1f} s, validated and stored in {time.perf_counter() - t:.1f} s "
              f"({size / len(dirs) / 2**20:.1f} MiB each, {size / 2**30:.2f} GiB in all)", flush=True)

        def engine(n: int) -> LLMEngine:
            lora = LoRAConfig(max_loras=max(32, n), max_cpu_loras=max(64, n), max_lora_rank=max(64, args.rank))
            cfg = EngineConfig(model=ModelConfig(model=str(model_dir), dtype=args.dtype), num_threads=args.threads,
                               scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs,
                                                         max_num_batched_tokens=args.max_num_batched_tokens),
                               lora=lora)
            return LLMEngine(cfg, LoRAManager(store, lora))

        rows: list[tuple[str, dict, dict[str, dict]]] = []

        def report(label: str, res: dict, hf: dict[str, dict]) -> None:
            base = rows[0][1]["tok_s"] if rows else res["tok_s"]
            line = (f"{label:<24} loraplex {res['tok_s']:7.1f} tok/s ({res['elapsed']:6.1f} s, {res['steps']} steps, "
                    f"warm-up {res['warm']:4.1f} s) = {res['tok_s'] / base:.2f}x base")
            for mode, h in hf.items():
                line += (f" | HF+PEFT {mode} {h['tok_s']:6.1f} tok/s ({h['elapsed']:.0f} s, adapter loads "
                         f"{h['load']:.1f} s): {res['tok_s'] / h['tok_s']:5.1f}x")
            print(line, flush=True)
            rows.append((label, res, hf))

        eng = engine(0)
        res = run_engine(eng, wl, [None] * len(wl.prompts))
        eng.lora.close()
        del eng
        hf = {"plain": run_hf(model_dir, hf_wl, [None] * hf_n, dtype, args.hf_batch, "")} if modes else {}
        report("base model", res, hf)
        for n in counts:
            # With one adapter every popularity assigns it every request: one run, not two
            # identical ones (whose difference would only be the machine's noise).
            for pop in pops[:1] if n == 1 else pops:
                idx = assign_adapters(len(wl.prompts), n, pop, args.zipf_s)
                used = Counter(idx)
                eng = engine(n)
                res = run_engine(eng, wl, [names[i] for i in idx])
                eng.lora.close()
                del eng
                hf = {m: run_hf(model_dir, hf_wl, [dirs[i] for i in idx[:hf_n]], dtype, args.hf_batch, m)
                      for m in modes}
                label = f"{n:>3} adapters, {pop:<7}"
                report(label, res, hf)
                print(f"{'':<24} {len(used)} distinct adapters used, hottest serves "
                      f"{max(used.values())}/{len(idx)} requests; {len(set(idx[:hf_n]))} distinct in the HF subset",
                      flush=True)
        if args.repeat_base:  # how much the machine drifted during the run
            eng = engine(0)
            res = run_engine(eng, wl, [None] * len(wl.prompts))
            eng.lora.close()
            del eng
            report("base model, again", res, {})
        summary = [{"config": label, "loraplex_tok_s": round(res["tok_s"], 2),
                    **{f"hf_{m}_tok_s": round(h["tok_s"], 2) for m, h in hf.items()}} for label, res, hf in rows]
        print(json.dumps(summary))
    finally:
        if args.workdir is None:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
