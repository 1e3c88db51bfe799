"""The JSON documents of the gateway <-> worker wire (WIRE.md), both directions.

Both sides use these functions, so a field added to `SamplingParams` or `RequestOutput`
travels without either side listing it twice.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from loraplex.engine.engine import RequestOutput
from loraplex.engine.errors import InvalidRequestError
from loraplex.engine.request import AdapterRef, Lane, SamplingParams
from loraplex.engine.structured.spec import StructuredOutput

STATS_HEADER = "x-loraplex-stats"
NDJSON = "application/x-ndjson"
_SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))
_OUTPUT_FIELDS = tuple(f.name for f in dataclasses.fields(RequestOutput) if f.name != "request_id")


def sampling_to_json(sampling: SamplingParams) -> dict[str, Any]:
    doc = {name: getattr(sampling, name) for name in _SAMPLING_FIELDS}
    so = sampling.structured_output
    doc["structured_output"] = None if so is None else {"kind": so.kind, "spec": so.spec, "strict": so.strict}
    return doc


def sampling_from_json(doc: Any) -> SamplingParams:
    """SamplingParams from the wire; InvalidRequestError names what is wrong."""
    if not isinstance(doc, Mapping):
        raise InvalidRequestError("sampling must be an object")
    unknown = sorted(set(doc) - _SAMPLING_FIELDS)
    if unknown:
        raise InvalidRequestError(f"sampling has unknown field {unknown[0]!r}")
    fields = dict(doc)
    so = fields.get("structured_output")
    if so is not None:
        if not isinstance(so, Mapping):
            raise InvalidRequestError("sampling.structured_output must be an object or null")
        fields["structured_output"] = StructuredOutput(so.get("kind"), so.get("spec", ""), bool(so.get("strict")))
    try:
        return SamplingParams(**fields)
    except TypeError as exc:
        raise InvalidRequestError(f"bad sampling parameters: {exc}") from None


def generate_body(request_id: str, prompt_token_ids: list[int], sampling: SamplingParams, lane: Lane,
                  adapter: AdapterRef | None, cache_salt: str, tenant: str = "") -> dict[str, Any]:
    return {"request_id": request_id, "prompt_token_ids": prompt_token_ids, "sampling": sampling_to_json(sampling),
            "lane": lane.name.lower(), "adapter": None if adapter is None else {"name": adapter.name,
                                                                                "digest": adapter.digest},
            "cache_salt": cache_salt, "tenant": tenant}


def output_to_json(out: RequestOutput) -> dict[str, Any]:
    return {"type": "output", **{name: getattr(out, name) for name in _OUTPUT_FIELDS}}


def output_from_json(doc: Mapping[str, Any], request_id: str) -> RequestOutput:
    """A worker's output line as the `RequestOutput` the engine produced."""
    out = RequestOutput(request_id, list(doc["new_token_ids"]), str(doc["new_text"]), bool(doc["finished"]))
    for name in _OUTPUT_FIELDS[3:]:
        if name in doc:
            setattr(out, name, doc[name])
    out.logprobs = [(lp, [tuple(p) for p in top]) for lp, top in out.logprobs]
    return out
