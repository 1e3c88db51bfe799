"""JSON schemas for the custom resources the chart may render, which kubernetes-validate
has no schema for. Written from the upstream CRDs' openAPIV3Schema: InferencePool
(inference.networking.k8s.io/v1, Gateway API Inference Extension) and ServiceMonitor
(monitoring.coreos.com/v1, Prometheus Operator; the fields the chart uses). Unknown fields
are rejected, as a structural CRD's pruning would silently drop them."""
from __future__ import annotations

from typing import Any

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


INFERENCE_POOL = _obj({
    "apiVersion": {"const": "inference.networking.k8s.io/v1"},
    "kind": {"const": "InferencePool"},
    "metadata": _META,
    "spec": _obj({
        "selector": _obj({"matchLabels": {**_LABELS, "minProperties": 1, "maxProperties": 64}},
                         ["matchLabels"]),
        "targetPorts": {"type": "array", "minItems": 1, "maxItems": 8,
                        "items": _obj({"number": _PORT}, ["number"])},
        "appProtocol": {"enum": ["http", "kubernetes.io/h2c"]},
        "endpointPickerRef": _obj({
            "group": {"type": "string", "maxLength": 253},
            "kind": {"type": "string", "minLength": 1, "maxLength": 63,
                     "pattern": r"^[a-zA-Z]([-a-zA-Z0-9]*[a-zA-Z0-9])?$"},
            "name": _NAME,
            "port": _obj({"number": _PORT}, ["number"]),
            "failureMode": {"enum": ["FailOpen", "FailClose"]},
        }, ["name"]),
    }, ["selector", "targetPorts", "endpointPickerRef"]),
}, ["apiVersion", "kind", "metadata", "spec"])
# The CRD's CEL rule: a Service reference (the default kind) must name its port.
INFERENCE_POOL["properties"]["spec"]["properties"]["endpointPickerRef"]["if"] = {
    "anyOf": [{"not": {"required": ["kind"]}}, {"properties": {"kind": {"const": "Service"}}}]}
INFERENCE_POOL["properties"]["spec"]["properties"]["endpointPickerRef"]["then"] = {"required": ["port"]}

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
