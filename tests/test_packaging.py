"""One import root: the repo's platform/, engine/ and adapters/ folders are installed only
as loraplex.platform, loraplex.engine and loraplex.adapters, so nothing shadows the
standard library's `platform` module."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
STDLIB = Path(sysconfig.get_paths()["stdlib"]).resolve()


def _py(code: str, cwd: Path | str) -> str:
    out = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_stdlib_platform_from_repo_root():
    # `python -c` puts the working directory first on sys.path: the repo's platform/
    # folder must not win over the standard library module.
    out = _py("import platform; print(platform.python_implementation()); print(platform.__file__)", REPO)
    impl, origin = out.splitlines()
    assert impl in ("CPython", "PyPy")
    assert Path(origin).resolve().parent == STDLIB, origin
    assert not (REPO / "platform" / "__init__.py").exists(), "platform/__init__.py would shadow the stdlib"


def test_loraplex_packages_import_from_repo_root():
    code = ("import platform, loraplex.platform, loraplex.engine, loraplex.adapters, json;"
            "print(json.dumps([platform.python_implementation(), loraplex.engine.__name__,"
            " loraplex.adapters.__name__, list(loraplex.platform.__path__)]))")
    for cwd in (REPO, "/tmp"):
        impl, eng, ada, plat_path = json.loads(_py(code, cwd))
        assert impl and eng == "loraplex.engine" and ada == "loraplex.adapters"
        # (an editable install adds a placeholder entry that is not a folder)
        assert [Path(p).resolve() for p in plat_path if Path(p).is_dir()] == [(REPO / "platform").resolve()]


def test_no_top_level_engine_adapters_or_platform_installed(tmp_path):
    # From a neutral directory only what is installed is importable.
    code = ("import importlib.util, json; s = lambda n: importlib.util.find_spec(n);"
            "print(json.dumps({n: (s(n).origin if s(n) else None) for n in"
            " ('engine', 'adapters', 'migrations', 'platform', 'loraplex.engine', 'loraplex.adapters',"
            " 'loraplex.platform')}))")
    specs = json.loads(_py(code, tmp_path))
    assert specs["engine"] is None and specs["adapters"] is None and specs["migrations"] is None
    origin = Path(specs["platform"]).resolve()
    assert origin.name == "platform.py" and origin.parent == STDLIB, origin
    assert Path(specs["loraplex.engine"]).resolve() == (REPO / "engine" / "__init__.py").resolve()
    assert Path(specs["loraplex.adapters"]).resolve() == (REPO / "adapters" / "__init__.py").resolve()


def test_wheel_has_a_single_loraplex_root(tmp_path):
    """Build the wheel (offline, from a copy so the checkout gains no build/) and list it."""
    pytest.importorskip("setuptools")
    src = tmp_path / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        if (REPO / name).exists():
            shutil.copy2(REPO / name, src / name)
    for folder in ("engine", "adapters", "platform", "migrations", "admin_ui"):
        shutil.copytree(REPO / folder, src / folder, ignore=ignore)
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                          "--no-index", "-q", "-w", str(tmp_path / "dist"), str(src)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    (wheel,) = (tmp_path / "dist").glob("loraplex-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    roots = {n.split("/")[0] for n in names}
    assert roots == {"loraplex", wheel.name.split("-")[0] + "-" + wheel.name.split("-")[1] + ".dist-info"}, roots
    assert "loraplex/engine/__init__.py" in names and "loraplex/adapters/__init__.py" in names
    assert {"loraplex/admin_ui/index.html", "loraplex/admin_ui/app.js", "loraplex/admin_ui/style.css"} <= set(names)
    assert any(n.startswith("loraplex/platform/") for n in names)
    assert "loraplex/platform/__init__.py" not in names
    assert "loraplex/__init__.py" not in names, "loraplex is a namespace root"
    top_level = [n for n in names if n.endswith(".dist-info/top_level.txt")]
    if top_level:
        assert zipfile.ZipFile(wheel).read(top_level[0]).decode().split() == ["loraplex"]
