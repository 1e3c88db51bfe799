"""The background demo training starts for the runs that need the demo adapters, and its
list of modules is every test module that trains them for the default model."""
from __future__ import annotations

from pathlib import Path

from tests.helpers.demo_training import NEEDS_DEMO, selected

ROOT = Path(__file__).resolve().parents[1]


def test_every_module_that_needs_the_demo_adapters_is_listed():
    users = {str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
             if p != Path(__file__).resolve() and "ensure_demo_adapters(smollm2_dir)" in p.read_text()}
    assert users == set(NEEDS_DEMO)


def test_a_run_needs_them_when_its_paths_take_in_a_listed_module(monkeypatch):
    monkeypatch.chdir(ROOT)
    assert selected([], ROOT) and selected(["tests"], ROOT) and selected(["tests/adapters"], ROOT)
    assert selected([str(ROOT / "tests/engine/lora/test_smollm2.py") + "::test_x"], ROOT)
    assert not selected(["tests/engine/runner", "tests/engine/lora/test_smollm2_kinds.py"], ROOT)
