"""The import layering in pyproject.toml's [tool.importlinter] holds (see `lint-imports`).

import-linter finds a package's modules on sys.path; the editable install maps
loraplex.engine, .adapters and .platform to the repo's folders through an import hook it
cannot follow, so the check runs on a `loraplex/` folder of links to those folders.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LINT = Path(sys.executable).with_name("lint-imports")


def test_import_contracts_hold(tmp_path):
    root = tmp_path / "loraplex"
    root.mkdir()
    for folder in ("engine", "adapters", "platform"):
        (root / folder).symlink_to(REPO / folder, target_is_directory=True)
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    out = subprocess.run([str(LINT), "--config", str(REPO / "pyproject.toml"), "--no-cache"], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "BROKEN" not in out.stdout, out.stdout
