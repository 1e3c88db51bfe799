"""Render helm/loraplex with Helm's own engine (helm-python-sdk, no helm binary) and
validate every manifest: Kubernetes kinds strictly against the API schemas
(kubernetes-validate), the CRDs the chart may emit against schemas written from their
upstream CRDs (crd_schemas.py)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from tests.helm.crd_schemas import validate_crd

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "loraplex"
KUBE_VERSION = "1.33"
RELEASE, NAMESPACE = "lpx", "serving"


class Rendered:
    """The manifests of one render, by kind and name."""

    def __init__(self, files: dict[str, str]) -> None:
        self.files = files
        self.docs: list[dict[str, Any]] = [
            d for path, text in sorted(files.items()) if path.endswith(".yaml")
            for d in yaml.safe_load_all(text) if d
        ]

    def kinds(self) -> list[str]:
        return sorted(d["kind"] for d in self.docs)

    def all(self, kind: str) -> list[dict[str, Any]]:
        return [d for d in self.docs if d["kind"] == kind]

    def one(self, kind: str, component: str | None = None) -> dict[str, Any]:
        found = [d for d in self.all(kind)
                 if component is None or d["metadata"]["labels"].get("app.kubernetes.io/component") == component]
        assert len(found) == 1, f"expected one {kind} {component or ''}, got {len(found)}"
        return found[0]

    def named(self, kind: str, name: str) -> dict[str, Any]:
        found = [d for d in self.all(kind) if d["metadata"]["name"] == name]
        assert len(found) == 1, f"no {kind} named {name}"
        return found[0]

    @property
    def notes(self) -> str:
        return next(text for path, text in self.files.items() if path.endswith("NOTES.txt"))


def validate_doc(doc: dict[str, Any]) -> None:
    if doc["apiVersion"].split("/")[0] in ("inference.networking.k8s.io", "monitoring.coreos.com"):
        validate_crd(doc)
    else:
        kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)


@pytest.fixture(scope="session")
def chart():
    return helm.Chart.load(str(CHART))


@pytest.fixture(scope="session")
def render(chart) -> Callable[..., Rendered]:
    """Validate the values against values.schema.json, render, and validate every manifest.
    Renders are shared by the tests asking for the same values (none modifies one)."""
    done: dict[str, Rendered] = {}

    def _render(values: dict[str, Any] | None = None) -> Rendered:
        key = json.dumps(values or {}, sort_keys=True)
        if key not in done:
            chart.validate_schema(values or {})
            out = Rendered(chart.render(values or {}, name=RELEASE, namespace=NAMESPACE, is_install=True))
            for doc in out.docs:
                validate_doc(doc)
            done[key] = out
        return done[key]

    return _render
