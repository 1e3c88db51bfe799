"""Session fixtures shared by every test package: the real default model and tiny models."""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import pytest
import torch

# `tests.helpers` must import under plain `pytest` too, not only `python -m pytest`
# (which puts the working directory on sys.path); importlib mode adds nothing itself.
_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from loraplex.engine.checkpoint import resolve_model_dir
from tests.helpers import demo_training
from tests.helpers.tiny_models import build_tiny_model_dir

# A busy 2-core machine is many times slower with torch's default thread count.
torch.set_num_threads(2)

_DEMO_TRAINING = pytest.StashKey["subprocess.Popen"]()


def pytest_sessionstart(session: pytest.Session) -> None:
    # Once per run (the controller, not each xdist worker): see tests/helpers/demo_training.py.
    config = session.config
    if hasattr(config, "workerinput") or config.option.collectonly:
        return
    if demo_training.selected(config.args, Path(_ROOT)):
        log = Path(tempfile.gettempdir()) / "loraplex-demo-training.log"
        config.stash[_DEMO_TRAINING] = demo_training.start(log)


def pytest_sessionfinish(session: pytest.Session) -> None:
    proc = session.config.stash.get(_DEMO_TRAINING, None)
    if proc is not None:
        demo_training.stop(proc)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    # Cache dir from LORAPLEX_CACHE_DIR or ~/.cache/loraplex, so the ~30 s GGUF
    # conversion happens once per machine, not once per test run.
    return resolve_model_dir("default")


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    return build_tiny_model_dir(tmp_path_factory.mktemp("tiny_llama"), "llama", tokenizer_dir=smollm2_dir)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    return build_tiny_model_dir(tmp_path_factory.mktemp("tiny_qwen2"), "qwen2", tokenizer_dir=smollm2_dir)


@pytest.fixture(scope="session")
def tiny_llama3rope_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    return build_tiny_model_dir(tmp_path_factory.mktemp("tiny_llama3rope"), "llama3rope", tokenizer_dir=smollm2_dir)
