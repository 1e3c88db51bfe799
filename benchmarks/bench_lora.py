"""Multi-LoRA throughput and TTFT where users are: many adapters against the base model.

One run, one seeded workload (vLLM bench's random dataset: prompts 256 +- 128 tokens,
outputs 128 +- 64, `ignore_eos`, greedy; 64 requests arriving at once), SmolLM2 in
bf16 on 2 threads, the in-process engine with its default LoRA settings:
  * 32 and 128 distinct rank-8 adapters on all seven projections, requests assigned
    uniformly (round-robin over a seeded shuffle) or by Zipf popularity (s=1.1),
  * 1,000 adapters of mixed ranks (8, 16, 32, 64) on q_proj and v_proj, uniform,
each served by an engine of its own in lockstep with a base model engine of its own
(benchmarks/lockstep.py: their steps interleaved one by one, each timed on its own
steps; timed one after another, the base model measured 0.87x itself minutes later on
these shared machines). Prints output tokens/s and TTFT p50 of each as ratios to its own
base model's, and the base model's row pooled over all pairs.
`--kinds N` adds N rank-8 adapters on all seven projections of each PEFT kind served
(plain LoRA, DoRA, lora_bias, trainable tokens, saved norms), uniform, and N mixtures of
two of the plain ones (a*0.5+b*0.5, each one segment of rank 16); one engine per kind, the
mixtures and the base model (prefix caching off), all serving the same requests with the
same adapter assignment, their steps interleaved one by one (a machine others share slows
each of them alike: engines timed one after another met different loads, and a minute of
someone else's work made one kind look 5x slower than the next), for --kind-rounds rounds.
Prints each one's mean step time (the fastest round) as a ratio to plain LoRA's, and the
mixtures' next to the sum of their parts: the base model's step plus twice plain LoRA's
cost over it (the same rows through two rank-8 adapters). Every engine runs the same
steps (printed), so mean step times compare like with like.

Adapters: PEFT writes one template per target set (make_random_peft_adapter); the rest
reuse its config and tensor names with the rank changed and seeded random bf16 values
written directly (1,000 take seconds, not PEFT's minutes). Each is validated by
AdapterStore.add. Before each timed run every adapter it uses serves one 1-token request
(loaded from disk into the CPU tier), like the base model's own warm-up; the timed run
then meets the engine's tiers as a server would: what its memory holds, it keeps.

`--quick` runs a few short requests over small adapter sets (the smoke test in
tests/benchmarks/ uses it). `--hf-modes grouped,mixed` adds transformers + PEFT serving
the same requests (grouped per adapter, or PEFT's mixed batches), slow: see --hf-prompts.

    python benchmarks/bench_lora.py                       # the full matrix (a few minutes)
    python benchmarks/bench_lora.py --quick
    python benchmarks/bench_lora.py --scenarios 32:uniform,1000:mixed --workdir /tmp/adapters
    python benchmarks/bench_lora.py --scenarios '' --kinds 8      # each kind and mixtures vs plain LoRA
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
from lockstep import Run, run_lockstep  # noqa: E402
from workload import Workload, left_padded, random_lengths  # noqa: E402

from loraplex.adapters import AdapterStore, BaseShapes  # noqa: E402
from loraplex.adapters.synth import make_random_peft_adapter  # noqa: E402
from loraplex.engine.config import CacheConfig, EngineConfig, LoRAConfig, ModelConfig, SchedulerConfig  # noqa: E402
from loraplex.engine.engine import LLMEngine  # noqa: E402
from loraplex.engine.checkpoint import resolve_model_dir  # noqa: E402
from loraplex.engine.lora import LoRAManager  # noqa: E402
from loraplex.engine.request import SamplingParams  # noqa: E402

ALL_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MIXED_RANKS = (8, 16, 32, 64)
DEFAULT_SCENARIOS = "32:uniform,32:zipf,128:uniform,128:zipf,1000:mixed"
QUICK_SCENARIOS = "3:uniform,5:mixed"


# The retrained tokens of the trainable-token kind: 16 ids among those the random prompts draw.
TRAINED_TOKENS = list(range(1000, 16000, 1000)) + [20000]
KINDS = {"plain": {}, "dora": {"use_dora": True}, "lora_bias": {"lora_bias": True},
         "tokens": {"trainable_token_indices": TRAINED_TOKENS},
         "saved_norm": {"modules_to_save": ["input_layernorm", "post_attention_layernorm", "norm"]}}


def make_adapters(model_dir: Path, root: Path, n: int, ranks: tuple[int, ...], targets: tuple[str, ...],
                  seed: int = 0, kind: str = "plain") -> list[Path]:
    """n valid PEFT folders, adapter i of rank ranks[i % len(ranks)]: PEFT writes a
    rank-1 template of `kind` (KINDS), the rest reuse its config and tensor names at
    their own rank (the tensors other than A and B, such as DoRA's magnitudes, lora_B's
    biases, saved norms and token rows: the template's, perturbed by seeded noise)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    template = make_random_peft_adapter(model_dir, root / "template", rank=1, alpha=2, target_modules=list(targets),
                                        seed=seed, init_scale=0.01, lora_config=KINDS[kind])
    config = json.loads((template / "adapter_config.json").read_text())
    with safe_open(str(template / "adapter_model.safetensors"), framework="pt") as f:
        layout = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    gen = torch.Generator().manual_seed(seed + 1)
    # One random pool per rank, sliced per adapter at a seeded offset: distinct content
    # (and digests) without drawing every tensor afresh.
    vectors = {k: v for k, v in layout.items()  # kept from the template
               if len(v) == 1 or (".lora_A." not in k and ".lora_B." not in k)}
    layout = {k: v for k, v in layout.items() if k not in vectors}
    with safe_open(str(template / "adapter_model.safetensors"), framework="pt") as f:
        vectors = {k: f.get_tensor(k) for k in vectors}
    need = {r: sum(a * b for a, b in layout.values()) * r for r in set(ranks)}
    pools = {r: (torch.randn(n_el + n, generator=gen) * 0.01).to(torch.bfloat16) for r, n_el in need.items()}
    dirs = []
    for i in range(n):
        r = ranks[i % len(ranks)]
        d = root / f"lora-{i:04d}"
        d.mkdir()
        (d / "adapter_config.json").write_text(json.dumps({**config, "r": r, "lora_alpha": 2 * r}))
        pos, tensors = i, {}  # a different offset per adapter
        for k, (a, b) in sorted(layout.items()):
            shape = (r, b) if "lora_A" in k else (a, r)  # A [r, in], B [out, r]
            size = shape[0] * shape[1]
            tensors[k] = pools[r][pos:pos + size].view(shape).clone()
            pos += size
        for k, v in vectors.items():
            tensors[k] = (v.float() * (1 + 0.01 * torch.randn(v.shape, generator=gen))).to(torch.bfloat16)
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


def compare_kinds(make_engine, wl: Workload, sets: dict, n: int, rounds: int) -> dict[str, float]:
    """Mean step time (ms) of the base model, each of KINDS and mixtures of two plain
    adapters over the same requests and adapter assignment (`run_lockstep`: their steps
    interleaved), the fastest of `rounds` rounds; printed as ratios to plain LoRA's, and
    the mixtures' to the sum of their parts."""
    idx = assign_adapters(len(wl.prompts), n, "uniform", 0.0)
    plain = sets["kind-plain"][0]
    assign = {"base": [None] * len(idx)} | {k: [sets[f"kind-{k}"][0][i] for i in idx] for k in KINDS}
    assign["mixture"] = [f"{plain[i]}*0.5+{plain[(i + 1) % n]}*0.5" if n > 1 else f"{plain[i]}*0.5" for i in idx]
    engines = {k: make_engine(enable_prefix_caching=False) for k in assign}  # every round does the same work
    times: dict[str, list[float]] = {k: [] for k in assign}
    for r in range(rounds):
        for config, run in run_lockstep(engines, wl, assign, first=r).items():
            times[config].append(run.step_ms)
            if r == 0:
                print(f"{n} rank-8 {config:<10} {run.steps} steps", flush=True)
    best = {k: min(v) for k, v in times.items()}
    for config, ms in best.items():
        print(f"{n} rank-8 {config:<10} mean step {ms:6.1f} ms = {ms / best['plain']:.3f}x plain LoRA's "
              f"(rounds: {', '.join(f'{t:.1f}' for t in times[config])} ms)", flush=True)
    parts = best["base"] + 2 * (best["plain"] - best["base"])  # two plain adapters' costs on one base step
    print(f"{n} mixtures of two rank-8 adapters: {best['mixture'] / best['plain']:.3f}x plain LoRA's step; the sum "
          f"of their parts (base + 2 x plain's cost over base, {parts:.1f} ms) is "
          f"{parts / best['plain']:.3f}x: the mixture costs {best['mixture'] / parts:.3f}x its parts", flush=True)
    for e in engines.values():
        e.lora.close()
    return best


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


def parse_scenarios(text: str) -> list[tuple[int, str]]:
    out = []
    for item in filter(None, text.split(",")):
        n, _, pop = item.partition(":")
        if pop not in ("uniform", "zipf", "mixed") or not n.isdigit() or int(n) < 1:
            raise SystemExit(f"bad scenario {item!r}: use N:uniform, N:zipf or N:mixed")
        out.append((int(n), pop))
    return out


def build_store(model_dir: Path, root: Path, scenarios: list[tuple[int, str]], kinds: int = 0
                ) -> tuple[dict[str, tuple[list[str], list[Path]]], AdapterStore]:
    """Adapter names and folders per adapter set ("rank8": every projection at rank 8;
    "mixed": q_proj and v_proj at ranks 8-64; "kind-<kind>": `kinds` rank-8 adapters of
    each of KINDS), as many as the largest scenario of each uses."""
    store = AdapterStore(root / "store", BaseShapes.from_model_dir(model_dir))
    sets = {"rank8": ((8,), ALL_MODULES), "mixed": (MIXED_RANKS, ("q_proj", "v_proj"))}
    sets |= {f"kind-{k}": ((8,), ALL_MODULES) for k in KINDS}
    out = {}
    for key, (ranks, targets) in sets.items():
        n = kinds if key.startswith("kind-") else max(
            (c for c, pop in scenarios if (pop == "mixed") == (key == "mixed")), default=0)
        if not n:
            continue
        folder = root / key
        if folder.is_dir() and len(list(folder.glob("lora-*"))) >= n:  # a --workdir of an earlier run
            dirs = sorted(folder.glob("lora-*"))[:n]
            out[key] = ([store.get(f"{key}-{d.name}").name for d in dirs], dirs)
            continue
        shutil.rmtree(folder, ignore_errors=True)
        t = time.perf_counter()
        dirs = make_adapters(model_dir, folder, n, ranks, targets, kind=key.removeprefix("kind-")
                             if key.startswith("kind-") else "plain")
        made = time.perf_counter() - t
        t = time.perf_counter()
        names = [store.add(f"{key}-{d.name}", d).name for d in dirs]
        size = sum(f.stat().st_size for d in dirs for f in d.iterdir())
        print(f"{n} {key} adapters: written in {made:.1f} s, validated and stored in {time.perf_counter() - t:.1f} s "
              f"({size / n / 2**20:.2f} MiB each)", flush=True)
        out[key] = (names, dirs)
    return out, store


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--input-range", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--output-range", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--scenarios", default=None, help=f"N:uniform|zipf|mixed, comma-separated ({DEFAULT_SCENARIOS})")
    ap.add_argument("--zipf-s", type=float, default=1.1)
    ap.add_argument("--kinds", type=int, default=0,
                    help="N adapters of each PEFT kind (plain, DoRA, lora_bias, trainable tokens, saved norms) "
                         "and N mixtures of two plain ones: step time vs plain LoRA")
    ap.add_argument("--kind-rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="6 short requests, small adapter sets: a smoke run")
    ap.add_argument("--hf-prompts", type=int, default=None,
                    help="serve only the first N requests with transformers + PEFT (its tok/s is on those)")
    ap.add_argument("--hf-batch", type=int, default=16)
    ap.add_argument("--hf-modes", default="", help="grouped and/or mixed: add transformers + PEFT (slow)")
    ap.add_argument("--workdir", default=None, help="where adapters are written (default: a temp dir, removed)")
    ap.add_argument("--json", default=None, help="also write the summary to this file")
    args = ap.parse_args()
    if args.quick:
        args.num_prompts, args.input_len, args.input_range, args.output_len, args.output_range = 6, 32, 16, 6, 3
    scenarios = parse_scenarios(args.scenarios if args.scenarios is not None else
                                (QUICK_SCENARIOS if args.quick else DEFAULT_SCENARIOS))
    torch.set_num_threads(args.threads)
    modes = [m for m in args.hf_modes.split(",") if m]
    wl = random_lengths(args.num_prompts, args.input_len, args.input_range, args.output_len, args.output_range)
    hf_n = min(args.hf_prompts or len(wl.prompts), len(wl.prompts))
    hf_wl = Workload(wl.prompts[:hf_n], wl.max_tokens[:hf_n])
    model_dir = resolve_model_dir(args.model)
    dtype = getattr(torch, args.dtype)
    print(f"workload: {len(wl.prompts)} requests at once, prompts {args.input_len}+-{args.input_range} (mean "
          f"{sum(map(len, wl.prompts)) / len(wl.prompts):.0f}), outputs {args.output_len}+-{args.output_range} "
          f"({wl.num_output_tokens} tokens, ignore_eos, greedy); {args.dtype}, {args.threads} threads; default "
          f"LoRAConfig {LoRAConfig()}", flush=True)

    tmp = Path(args.workdir or tempfile.mkdtemp(prefix="bench-lora-"))
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        sets, store = build_store(model_dir, tmp, scenarios, args.kinds)

        def engine(**cache) -> LLMEngine:
            lora = LoRAConfig()
            cfg = EngineConfig(model=ModelConfig(model=str(model_dir), dtype=args.dtype), num_threads=args.threads,
                               cache=CacheConfig(**cache),
                               # --quick: fewer batch widths to warm up
                               scheduler=SchedulerConfig(max_num_seqs=8) if args.quick else SchedulerConfig(),
                               lora=lora)
            return LLMEngine(cfg, LoRAManager(store, lora))

        rows: list[dict] = []

        def report(label: str, run: Run, base: Run, hf: dict[str, dict]) -> None:
            res = {"config": label, "tok_s": run.tok_s, "tok_s_ratio": run.tok_s / base.tok_s,
                   "ttft_p50": run.ttft_p(50), "ttft_p50_ratio": run.ttft_p(50) / base.ttft_p(50),
                   "step_ms": run.step_ms, "base_tok_s": base.tok_s}
            line = (f"{label:<22} {run.tok_s:7.1f} tok/s = {res['tok_s_ratio']:.2f}x base ({base.tok_s:5.1f}) | "
                    f"step {run.step_ms:6.1f} ms | TTFT p50 {run.ttft_p(50):5.2f} s = {res['ttft_p50_ratio']:.2f}x "
                    f"base (p99 {run.ttft_p(99):5.2f} s) | {run.seconds:5.1f} s, {run.steps} steps "
                    f"({run.idle_steps} idle), {run.preemptions} preemptions, warm-up {run.warm_seconds:4.1f} s")
            for mode, h in hf.items():
                res[f"hf_{mode}_tok_s"] = h["tok_s"]
                line += f" | HF+PEFT {mode} {h['tok_s']:6.1f} tok/s: {run.tok_s / h['tok_s']:5.1f}x"
            print(line, flush=True)
            rows.append(res)

        def paired(label: str, names: list[str | None]) -> tuple[Run, Run]:
            """The scenario and a base model engine of its own in lockstep: (base, scenario)."""
            engines = {"base": engine(), label: engine()}
            runs = run_lockstep(engines, wl, {"base": [None] * len(names), label: names})
            for e in engines.values():
                if e.lora is not None:
                    e.lora.close()
            return runs["base"], runs[label]

        def hf_runs(dirs: list[Path | None]) -> dict[str, dict]:
            return {m: run_hf(model_dir, hf_wl, dirs[:hf_n], dtype, args.hf_batch, m if dirs[0] else "")
                    for m in (modes if dirs[0] else modes[:1])}

        none = [None] * len(wl.prompts)
        bases, results = [], []
        for n, pop in scenarios:
            names, dirs = sets["mixed" if pop == "mixed" else "rank8"]
            idx = assign_adapters(len(wl.prompts), n, "uniform" if pop == "mixed" else pop, args.zipf_s)
            label = f"{n:>4} adapters, {pop}"
            base, run = paired(label, [names[i] for i in idx])
            used = Counter(idx)
            print(f"{label:<22} {run.tok_s:7.1f} tok/s beside the base model's {base.tok_s:7.1f}: "
                  f"{len(used)} distinct adapters used, the hottest serves {max(used.values())}/{len(idx)} requests",
                  flush=True)
            bases.append(base)
            results.append((label, run, base, hf_runs([dirs[i] for i in idx])))
        if not scenarios and not args.kinds:
            bases.append(run_lockstep({"base": engine()}, wl, {"base": none})["base"])
        if bases:  # every scenario's own base, pooled: the base model's row
            pooled = Run(seconds=sum(b.seconds for b in bases), steps=sum(b.steps for b in bases),
                         tokens=sum(b.tokens for b in bases), ttft=[t for b in bases for t in b.ttft],
                         warm_seconds=bases[0].warm_seconds)
            report("base model", pooled, pooled, hf_runs([None] * len(wl.prompts)))
        for label, run, base, hf in results:
            report(label, run, base, hf)
        kinds = compare_kinds(engine, wl, sets, args.kinds, args.kind_rounds) if args.kinds else {}
        keys = ("config", "tok_s", "tok_s_ratio", "ttft_p50", "ttft_p50_ratio", "step_ms", "base_tok_s")
        summary = [{k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()
                    if k in keys or k.startswith("hf_")} for r in rows]
        summary += [{"config": f"{args.kinds} rank-8 {k}", "step_ms": round(ms, 3),
                     "step_vs_plain": round(ms / kinds["plain"], 3)} for k, ms in kinds.items()]
        if kinds:
            parts = kinds["base"] + 2 * (kinds["plain"] - kinds["base"])
            summary[-1]["step_vs_parts"] = round(kinds["mixture"] / parts, 3)
        print(json.dumps(summary))
        if args.json:
            Path(args.json).write_text(json.dumps(summary, indent=1))
    finally:
        if args.workdir is None:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
