"""The Grafana dashboard queries only series that loraplex exports, with labels they carry."""
from __future__ import annotations

import json
import re
from pathlib import Path

from loraplex.engine.client import EngineStats
from loraplex.engine.request import Lane
from loraplex.platform.metrics import Metrics

DASHBOARD = Path(__file__).resolve().parents[3] / "deploy" / "grafana" / "loraplex.json"
SERIES = re.compile(r"((?:vllm|loraplex):[a-z0-9_]+)(\{[^}]*\})?")


def exported() -> dict[str, set[str]]:
    """Sample name -> label names, of everything the gateway's /metrics exports."""
    gateway = Metrics("tiny", EngineStats, max_lora=2)
    gateway.request_started("sql", Lane.INTERACTIVE)
    gateway.first_token("sql", Lane.INTERACTIVE, 0.2, 3, 0.1, 0.1)
    gateway.generated("sql", Lane.INTERACTIVE, 3)
    gateway.request_finished("sql", Lane.INTERACTIVE, False, 1.0, "stop", 0.5, 3)
    m = gateway.requests
    m.adapter_loaded("sql", 0.1)
    m.adapter_evicted("sql")
    m.preempted("batch")
    gateway.api_request("/v1/completions", 200)
    gateway.render()
    out: dict[str, set[str]] = {}
    for family in gateway.registry.collect():
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
