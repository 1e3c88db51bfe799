"""lm-evaluation-harness's `local-completions` model with `batch_size` 4 against a live
`loraplex serve` process, on tiny tasks written here (a local jsonl dataset, nothing
downloaded): its batches arrive as lists of prompts (token-id lists through the remote
tokenizer, which reads /tokenizer_info, /tokenize and /detokenize; strings through the
model folder's own tokenizer). The oracle is lm-eval's own `hf` model with PEFT on the
same checkpoint and adapter, served here with vLLM's `--lora-modules`."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from loraplex.platform.db.database import Database, migrate
from loraplex.platform.tenancy.tenants import create_key, create_tenant
from tests.e2e.fleet import processes as P
from tests.platform.fixtures import tiny_adapters  # noqa: F401 - fixture

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is in the test extras")

MC_DOCS = [{"question": f"Question {i}: which word comes next after {w}?", "choices": c, "answer": i % len(c)}
           for i, (w, c) in enumerate([("sun", ["moon", "star", "sky"]), ("cat", ["dog", "mouse"]),
                                        ("red", ["blue", "green", "yellow", "white"]), ("one", ["two", "three"]),
                                        ("up", ["down", "left", "right"]), ("hot", ["cold", "warm"]),
                                        ("east", ["west", "north", "south"]), ("yes", ["no", "maybe"]),
                                        ("day", ["night", "noon"])])]
GEN_DOCS = [{"text": f"Count with me: {i}, {i + 1},", "target": f" {i + 2}"} for i in range(6)]


def _tasks(root: Path) -> Path:
    (root / "mc.jsonl").write_text("".join(json.dumps(d) + "\n" for d in MC_DOCS))
    (root / "gen.jsonl").write_text("".join(json.dumps(d) + "\n" for d in GEN_DOCS))
    (root / "lpx_mc.yaml").write_text(f"""task: lpx_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {root / 'mc.jsonl'}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
""")
    (root / "lpx_gen.yaml").write_text(f"""task: lpx_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {root / 'gen.jsonl'}
test_split: test
output_type: generate_until
doc_to_text: "{{{{text}}}}"
doc_to_target: "{{{{target}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 6
  do_sample: false
metric_list:
  - metric: exact_match
""")
    return root


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_llama_dir, tiny_adapters):  # noqa: F811
    logs = tmp_path_factory.mktemp("lm_eval")
    url = f"sqlite:///{logs / 'lpx.db'}"
    migrate(url)
    db = Database(url)
    create_tenant(db, "evals")
    key = create_key(db, "evals")
    db.dispose()
    proc = P.serve(tiny_llama_dir, logs, "serve", "--database-url", url, "--max-model-len", "256",
                   "--num-kv-blocks", "128", "--lora-modules", f"mine={tiny_adapters['ad1']}").start()
    try:
        proc.wait_ready()
        yield proc, key, logs
    finally:
        proc.stop()


def _evaluate(model: str, model_args: dict, tasks: list[str], task_dir: Path, key: str | None = None) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    if key is not None:
        os.environ["OPENAI_API_KEY"] = key  # local-completions sends it as the bearer key
    args = ",".join(f"{k}={v}" for k, v in model_args.items())
    return simple_evaluate(model=model, model_args=args, tasks=tasks, batch_size=4, log_samples=True,
                           task_manager=TaskManager(include_path=str(task_dir)), random_seed=0, numpy_random_seed=0,
                           torch_random_seed=0, fewshot_random_seed=0)


def _loglikelihoods(out: dict, task: str) -> list[list[float]]:
    samples = sorted(out["samples"][task], key=lambda s: s["doc_id"])
    return [[r[0][0] for r in s["resps"]] for s in samples]


def _served_usage_events(logs: Path) -> list[dict]:
    from tests.e2e.usage_support import export_events

    db = Database(f"sqlite:///{logs / 'lpx.db'}")
    try:
        return export_events(db, "evals")
    finally:
        db.dispose()


def test_lm_eval_local_completions_batches_against_serve(server, tmp_path, tiny_llama_dir, tiny_adapters):  # noqa: F811
    proc, key, logs = server
    task_dir = _tasks(tmp_path)
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    base = f"{proc.url}/v1/completions"
    remote = _evaluate("local-completions", {"base_url": base, "model": "mine", "tokenizer_backend": "remote",
                                             "tokenized_requests": True, "auth_token": key, "max_length": 256,
                                             "num_concurrent": 1, "max_retries": 1},
                       ["lpx_mc", "lpx_gen"], task_dir, key)
    strings = _evaluate("local-completions", {"base_url": base, "model": "mine", "tokenizer_backend": "huggingface",
                                              "tokenizer": str(tiny_llama_dir), "tokenized_requests": False,
                                              "max_length": 256, "num_concurrent": 1, "max_retries": 1},
                        ["lpx_mc", "lpx_gen"], task_dir, key)
    oracle = _evaluate("hf", {"pretrained": str(tiny_llama_dir), "peft": str(tiny_adapters["ad1"]),
                              "dtype": "float32", "device": "cpu", "max_length": 256}, ["lpx_mc", "lpx_gen"], task_dir)

    want = _loglikelihoods(oracle, "lpx_mc")
    for got in (_loglikelihoods(remote, "lpx_mc"), _loglikelihoods(strings, "lpx_mc")):
        assert [len(x) for x in got] == [len(x) for x in want]
        for g, w in zip(got, want):
            assert g == pytest.approx(w, abs=2e-3)
    assert remote["results"]["lpx_mc"]["acc,none"] == oracle["results"]["lpx_mc"]["acc,none"]
    gen = [s["resps"][0][0] for s in sorted(oracle["samples"]["lpx_gen"], key=lambda s: s["doc_id"])]
    for out in (remote, strings):
        assert [s["resps"][0][0] for s in sorted(out["samples"]["lpx_gen"], key=lambda s: s["doc_id"])] == gen

    # lm-eval sent its batches as prompt lists: fewer HTTP requests (one usage event each)
    # than prompts, and at least one event billed several prompts' tokens.
    events = _served_usage_events(logs)
    prompts = 2 * (sum(len(d["choices"]) for d in MC_DOCS) + len(GEN_DOCS))
    assert 0 < len(events) < prompts
