"""The Grafana dashboard queries only series that loraplex exports, with labels they carry."""
from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client import CollectorRegistry

from loraplex.platform.serving.metrics import Metrics
from loraplex.platform.observability.request_metrics import SUPERSEDES, RequestMetrics

DASHBOARD = Path(__file__).resolve().parents[3] / "deploy" / "grafana" / "loraplex.json"
SERIES = re.compile(r"((?:vllm|loraplex):[a-z0-9_]+)(\{[^}]*\})?")


def exported() -> dict[str, set[str]]:
    """Sample name -> label names, of the request metrics and the gateway's other series."""
    reg = CollectorRegistry()
    m = RequestMetrics(reg, "tiny")
    m.first_token("interactive", "sql", queue_s=0.1, prefill_s=0.1, prompt_tokens=3)
    m.generated("interactive", "sql", 3)
    m.finished("interactive", "sql", e2e_s=1.0, decode_s=0.5, output_tokens=3)
    m.adapter_loaded("sql", 0.1)
    m.adapter_evicted("sql")
    m.preempted("batch")
    gateway = Metrics("tiny", lambda: {"lanes": {}}, max_lora=2)
    gateway.request_started(None, 0)
    gateway.request_finished(None, 0, True, 1.0, "stop")
    gateway.api_request("/v1/completions", 200)
    out: dict[str, set[str]] = {}
    for registry, skip in ((reg, set()), (gateway.registry, SUPERSEDES)):
        for family in registry.collect():
            if family.name in skip:
                continue
            for s in family.samples:
                out.setdefault(s.name, set()).update(s.labels)
    return out


def test_every_queried_series_and_label_exists():
    dash = json.loads(DASHBOARD.read_text())
    series = exported()
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    exprs += [v["query"]["query"] for v in dash["templating"]["list"] if isinstance(v.get("query"), dict)]
    assert len(exprs) > 20
    for expr in exprs:
        for name, selector in SERIES.findall(expr):
            assert name in series, f"{name} is not exported ({expr})"
            labels = set(re.findall(r"([a-z_]+)\s*=~?", selector or "")) - {"le"}
            assert labels <= series[name], f"{name} has no label {labels - series[name]} ({expr})"
        for by in re.findall(r"by \(([^)]*)\)", expr):
            assert "tenant" not in by


def test_panels_do_not_overlap():
    cells = set()
    for p in json.loads(DASHBOARD.read_text())["panels"]:
        g = p["gridPos"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, p["title"]
                cells.add((x, y))
