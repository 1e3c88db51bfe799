"""The repo's platform/ folder must never shadow the standard library's `platform`."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_stdlib_platform_imports_from_repo_root():
    code = "import platform, sys; print(platform.__file__); print(platform.python_version())"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    path = out.stdout.splitlines()[0]
    assert not path.startswith(str(REPO)), path
    assert not (REPO / "platform" / "__init__.py").exists()


def test_migrations_ship_beside_the_platform_package():
    from loraplex.platform.db import migrations_dir

    assert (migrations_dir() / "env.py").is_file()
    assert any(migrations_dir().joinpath("versions").glob("*.py"))
