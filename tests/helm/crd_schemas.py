"""JSON schemas for the custom resources the chart may render, which kubernetes-validate
has no schema for. InferencePool (inference.networking.k8s.io/v1, Gateway API Inference
Extension): the upstream CRD's openAPIV3Schema itself (data/inferencepool-v1.json), with
its CEL rules read in Python. ServiceMonitor (monitoring.coreos.com/v1, Prometheus
Operator): written from its CRD, the fields the chart uses. Unknown fields are rejected,
as a structural CRD's pruning would silently drop them."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import jsonschema

_NAME = {"type": "string", "minLength": 1, "maxLength": 253}
_PORT = {"type": "integer", "minimum": 1, "maximum": 65535}
_LABELS = {"type": "object", "additionalProperties": {
    "type": "string", "maxLength": 63, "pattern": r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"}}
_META = {"type": "object", "required": ["name"], "properties": {
    "name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", "maxLength": 63},
    "labels": _LABELS, "annotations": {"type": "object"}}}


def _obj(props: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {"type": "object", "additionalProperties": False, "properties": props, "required": required or []}


def _strict(node: Any) -> Any:
    """The CRD's OpenAPI schema as a JSON schema that rejects unknown fields (what the API
    server's strict field validation does; a structural CRD would otherwise drop them)."""
    if isinstance(node, list):
        return [_strict(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: _strict(v) for k, v in node.items() if not k.startswith("x-kubernetes-")}
    if "properties" in node and "additionalProperties" not in node:
        out["additionalProperties"] = False
    return out


# The CRD's CEL rules, by their exact text, each as Python over the object it is on (with
# the CRD's defaults applied); a rule not listed here fails the validation, so a refreshed
# CRD with a new rule is noticed.
_CEL: dict[str, Callable[[Any], bool]] = {
    "self.kind != 'Service' || has(self.port)": lambda o: o.get("kind", "Service") != "Service" or "port" in o,
    "self.all(p1, self.exists_one(p2, p1.number==p2.number))":
        lambda o: len({p["number"] for p in o}) == len(o),
}


def _cel_rules(schema: dict[str, Any], doc: Any, path: str = "") -> None:
    for rule in schema.get("x-kubernetes-validations", ()):
        check = _CEL.get(rule["rule"])
        if check is None:
            raise ValueError(f"{path or '.'}: no Python reading of the CRD rule {rule['rule']!r}")
        if not check(doc):
            raise jsonschema.ValidationError(f"{path or '.'}: {rule['message']}")
    if isinstance(doc, dict):
        for key, sub in schema.get("properties", {}).items():
            if key in doc:
                _cel_rules(sub, doc[key], f"{path}.{key}")
    elif isinstance(doc, list) and "items" in schema:
        for i, item in enumerate(doc):
            _cel_rules(schema["items"], item, f"{path}[{i}]")


_INFERENCE_POOL_CRD = json.loads((Path(__file__).parent / "data" / "inferencepool-v1.json").read_text())
INFERENCE_POOL = _strict(_INFERENCE_POOL_CRD)
INFERENCE_POOL["properties"].update(apiVersion={"const": "inference.networking.k8s.io/v1"},
                                    kind={"const": "InferencePool"}, metadata=_META)
INFERENCE_POOL["required"] = ["apiVersion", "kind", "metadata", "spec"]

_DURATION = {"type": "string", "pattern": r"^(0|(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"}
SERVICE_MONITOR = _obj({
    "apiVersion": {"const": "monitoring.coreos.com/v1"},
    "kind": {"const": "ServiceMonitor"},
    "metadata": _META,
    "spec": _obj({
        "jobLabel": {"type": "string"},
        "selector": _obj({"matchLabels": _LABELS, "matchExpressions": {"type": "array"}}),
        "namespaceSelector": _obj({"any": {"type": "boolean"},
                                   "matchNames": {"type": "array", "items": {"type": "string"}}}),
        "endpoints": {"type": "array", "minItems": 1, "items": _obj({
            "port": {"type": "string"}, "targetPort": {"type": ["integer", "string"]},
            "path": {"type": "string", "pattern": "^/"}, "scheme": {"enum": ["http", "https"]},
            "interval": _DURATION, "scrapeTimeout": _DURATION,
            "honorLabels": {"type": "boolean"}, "bearerTokenSecret": {"type": "object"},
            "authorization": _obj({"type": {"type": "string"}, "credentials": _obj(
                {"name": _NAME, "key": {"type": "string", "minLength": 1}, "optional": {"type": "boolean"}},
                ["key"])}),
        })},
    }, ["selector", "endpoints"]),
}, ["apiVersion", "kind", "metadata", "spec"])

_SCHEMAS = {"InferencePool": INFERENCE_POOL, "ServiceMonitor": SERVICE_MONITOR}


def validate_crd(doc: dict[str, Any]) -> None:
    """Raise jsonschema.ValidationError when `doc` is not a valid instance of its CRD."""
    schema = _SCHEMAS.get(doc["kind"])
    if schema is None:
        raise ValueError(f"no schema for custom resource kind {doc['kind']}")
    jsonschema.validate(doc, schema)
    if schema is INFERENCE_POOL:
        _cel_rules(_INFERENCE_POOL_CRD, doc)
