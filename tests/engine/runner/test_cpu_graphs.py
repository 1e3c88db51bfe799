"""Replayed decode steps on the "cpu" backend (runner/cpu_graphs.py): the same tokens as
eager steps, recorded only where every op in the layers is a C kernel call."""
from __future__ import annotations

import pytest

from loraplex.adapters import AdapterStore, BaseShapes
from loraplex.adapters.synth import make_random_peft_adapter
from loraplex.engine.config import CacheConfig, EngineConfig, LoRAConfig, ModelConfig, SchedulerConfig
from loraplex.engine.engine import LLMEngine
from loraplex.engine.lora import LoRAManager
from loraplex.engine.kernels.cpu import fused
from loraplex.engine.models.llama import TorchLayerOps
from loraplex.engine.request import SamplingParams

pytestmark = pytest.mark.skipif(fused.load_library() is None, reason="no C compiler to build the CPU kernels")

PROMPTS = [[100 + i, 7, 250 + 3 * i, 11, 42] * (1 + i) for i in range(4)]


def _engine(model_dir, eager: bool = False, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=ModelConfig(model=str(model_dir), dtype="bfloat16"), kernels="cpu",
                                  cache=CacheConfig(block_size=16), scheduler=SchedulerConfig(max_num_seqs=4),
                                  enforce_eager=eager, **kw))


def _tokens(engine: LLMEngine, max_tokens: int = 40) -> list[list[int]]:
    # outputs of different lengths: the batch narrows from 4 rows to 1 as they finish
    params = [SamplingParams(max_tokens=max_tokens - 7 * i, temperature=0, ignore_eos=True) for i in range(4)]
    ids = [engine.add_request(p, sp) for p, sp in zip(PROMPTS, params)]
    got: dict[str, list[int]] = {i: [] for i in ids}
    while engine.has_unfinished_requests():
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
    return [got[i] for i in ids]


@pytest.mark.parametrize("model", ["tiny_llama_dir", "tiny_qwen2_dir", "tiny_llama3rope_dir"])
def test_replayed_steps_make_the_eager_tokens(model, request):
    model_dir = request.getfixturevalue(model)
    graphs = _engine(model_dir)
    got = _tokens(graphs)
    assert got == _tokens(_engine(model_dir, eager=True))
    runner = graphs.runner
    # 4 rows for 19 steps (contexts crossing blocks of 16), then 3, 2 and 1 for 7 each
    assert runner.cpu_graphs.replays >= 4 * 5 and not runner.cpu_graphs.eager_only
    assert set(runner.cpu_graphs.graphs) <= {1, 2, 3, 4}


def test_enforce_eager_records_nothing(tiny_llama_dir):
    assert _engine(tiny_llama_dir, eager=True).runner.cpu_graphs is None


class _TorchSiluMul:
    """The C layer ops, but SiLU-and-multiply by torch: an op a replay would skip."""

    def __init__(self, ops) -> None:
        self.ops = ops

    def __getattr__(self, name: str):
        return getattr(self.ops, name)

    silu_mul = staticmethod(TorchLayerOps.silu_mul)


def test_a_width_whose_layers_compute_in_torch_runs_eagerly(tiny_llama_dir):
    want = _tokens(_engine(tiny_llama_dir, eager=True))
    engine = _engine(tiny_llama_dir)
    layer = engine.runner.model.layers[1]
    layer.ops = _TorchSiluMul(layer.ops)
    assert _tokens(engine) == want
    graphs = engine.runner.cpu_graphs
    assert graphs.replays == 0 and not graphs.graphs and graphs.eager_only == {4, 3, 2, 1}


def test_at_most_max_widths_are_kept(tiny_llama_dir):
    engine = _engine(tiny_llama_dir)
    graphs = engine.runner.cpu_graphs
    graphs.max_widths = 2
    _tokens(engine)
    assert list(graphs.graphs) == [2, 1]  # the last two widths met, the older ones let go
    assert graphs.replays > 0


def test_steps_with_adapter_rows_run_eagerly_and_base_steps_replay(tiny_llama_dir, tmp_path):
    store = AdapterStore(tmp_path / "store", BaseShapes.from_model_dir(tiny_llama_dir))
    store.add("a", make_random_peft_adapter(tiny_llama_dir, tmp_path / "a", rank=4, alpha=8, seed=1, init_scale=0.3))

    def run(eager: bool) -> tuple[list[list[int]], LLMEngine]:
        cfg = EngineConfig(model=ModelConfig(model=str(tiny_llama_dir), dtype="bfloat16"), kernels="cpu",
                           scheduler=SchedulerConfig(max_num_seqs=4), lora=LoRAConfig(max_loras=2),
                           enforce_eager=eager)
        engine = LLMEngine(cfg, LoRAManager(store, cfg.lora))
        # two base requests and one with the adapter, the adapter's the shortest: its
        # steps are eager, the base rows' steps after it replay
        lengths, adapters = (30, 30, 12), (None, None, "a")
        ids = [engine.add_request(p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True), adapter=a)
               for p, n, a in zip(PROMPTS, lengths, adapters)]
        got: dict[str, list[int]] = {i: [] for i in ids}
        while engine.has_unfinished_requests():
            for out in engine.step():
                got[out.request_id] += out.new_token_ids
        return [got[i] for i in ids], engine

    want, _ = run(eager=True)
    got, engine = run(eager=False)
    assert got == want
    graphs = engine.runner.cpu_graphs
    assert set(graphs.graphs) == {2} and 10 <= graphs.replays <= 17  # only the 2-row base steps


def test_prefill_steps_are_not_recorded(tiny_llama_dir):
    engine = _engine(tiny_llama_dir)
    engine.add_request(PROMPTS[0], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    engine.step()  # the prompt's prefill chunk (and its first token)
    graphs = engine.runner.cpu_graphs
    assert graphs.last_width == 0 and not graphs.graphs
