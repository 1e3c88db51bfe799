"""The gateway <-> worker wire (platform/fleet/WIRE.md): JSON codecs both sides share.

Everything here is plain data in, plain data out: a generate request, a sampling
configuration and a `RequestOutput` line. The error body that carries a domain error's
class name across the hop is `platform.fleet.errors`. Bad input raises
`InvalidRequestError` naming the field at fault.
"""
from __future__ import annotations

import dataclasses
import numbers
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from loraplex.engine.output import RequestOutput
from loraplex.engine.errors import InvalidRequestError
from loraplex.engine.mixtures import MAX_COMPONENTS, mixture_ref
from loraplex.engine.request import AdapterRef, Lane, SamplingParams
from loraplex.engine.structured.spec import StructuredOutput

from loraplex.platform.errors import ConfigError, WeakSecretError
from loraplex.platform.lanes import lane_name, lane_named
from loraplex.platform.routing.view import prefix_key

STATS_HEADER = "x-loraplex-stats"  # the worker's WorkerStats JSON at admission
NDJSON = "application/x-ndjson"
TOKEN_ENV = "LORAPLEX_INTERNAL_TOKEN"
TOKEN_FILE_ENV = "LORAPLEX_INTERNAL_TOKEN_FILE"
MIN_TOKEN_CHARS = 16  # as for the admin token


def internal_token(explicit: str | None = None) -> str | None:
    """The internal API's shared secret: `explicit`, else $LORAPLEX_INTERNAL_TOKEN, else
    the file $LORAPLEX_INTERNAL_TOKEN_FILE names; None when none is set. Surrounding
    whitespace is not part of it (a Secret made from a file often ends in a newline, and
    a gateway sending it would fail every call). WeakSecretError below MIN_TOKEN_CHARS."""
    source = "the configured internal token"
    token = explicit
    if token is None and os.environ.get(TOKEN_ENV, "").strip():
        token, source = os.environ[TOKEN_ENV], f"${TOKEN_ENV}"
    elif token is None and os.environ.get(TOKEN_FILE_ENV):
        path = os.environ[TOKEN_FILE_ENV]
        try:
            token, source = Path(path).read_text(), f"the file ${TOKEN_FILE_ENV} names ({path})"
        except OSError as exc:
            raise ConfigError(f"${TOKEN_FILE_ENV}: cannot read {path}: {exc.strerror}") from None
    token = (token or "").strip()
    if not token:
        return None
    if len(token) < MIN_TOKEN_CHARS:
        raise WeakSecretError(f"the internal token from {source} is too short ({len(token)} characters): use at "
                              f"least {MIN_TOKEN_CHARS} random characters, the same on gateways and workers "
                              "(e.g. `python -c 'import secrets; print(secrets.token_urlsafe(32))'`)")
    return token


# -- requests ----------------------------------------------------------------------------
@dataclass(frozen=True)
class GenerateRequest:
    """`POST /internal/v1/generate`'s body, validated."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    lane: Lane = Lane.STANDARD
    adapter: AdapterRef | None = None
    cache_salt: str = ""
    tenant: str = ""
    # Tenant-fair scheduling: the tenant's weight; the engine's deadline (seconds, None: none).
    tenant_weight: float = 1.0
    timeout: float | None = None

    @property
    def prefix_key(self) -> str | None:
        """The routing key of its leading tokens: the gateway routes by it, the worker
        reports it once served; one definition on the fields both sides hold."""
        return prefix_key(self.cache_salt, self.adapter.digest if self.adapter is not None else None,
                          self.prompt_token_ids)

    def to_json(self) -> dict[str, Any]:
        return {"request_id": self.request_id, "prompt_token_ids": list(self.prompt_token_ids),
                "sampling": sampling_to_json(self.sampling), "lane": lane_name(self.lane),
                "adapter": adapter_to_json(self.adapter),
                "cache_salt": self.cache_salt, "tenant": self.tenant, "tenant_weight": self.tenant_weight,
                "timeout": self.timeout}

    @classmethod
    def from_json(cls, doc: Any) -> GenerateRequest:
        doc = _object(doc, "the request body")
        _no_unknown(doc, {f.name for f in dataclasses.fields(cls)}, "the request body")
        rid = doc.get("request_id")
        if not isinstance(rid, str) or not 0 < len(rid) <= 256:
            raise InvalidRequestError("'request_id' must be a string of 1 to 256 characters")
        ids = doc.get("prompt_token_ids")
        if not isinstance(ids, list) or not ids or not all(_is_int(t) for t in ids):
            raise InvalidRequestError("'prompt_token_ids' must be a non-empty list of integers")
        lane_doc = doc.get("lane", "standard")
        if not isinstance(lane_doc, str):
            raise InvalidRequestError("'lane' must be interactive, standard or batch")
        lane = lane_named(lane_doc)
        if lane is None:
            raise InvalidRequestError(f"unknown lane {lane_doc!r}; use interactive, standard or batch")
        weight, timeout = doc.get("tenant_weight", 1.0), doc.get("timeout")
        if not _is_number(weight) or not 0 < weight < float("inf"):
            raise InvalidRequestError("'tenant_weight' must be a finite number > 0")
        if timeout is not None and (not _is_number(timeout) or not 0 < timeout < float("inf")):
            raise InvalidRequestError("'timeout' must be null or a finite number of seconds > 0")
        return cls(rid, ids, sampling_from_json(doc.get("sampling", {})), lane,
                   adapter_from_json(doc.get("adapter")), _str(doc, "cache_salt"), _str(doc, "tenant"),
                   float(weight), None if timeout is None else float(timeout))


def adapter_to_json(ref: AdapterRef | None) -> dict[str, Any] | None:
    """A ref on the wire; a mixture (engine/mixtures.py) also carries its components."""
    if ref is None:
        return None
    doc: dict[str, Any] = {"name": ref.name, "digest": ref.digest}
    if ref.mixture:
        doc["mixture"] = [{"name": c.name, "digest": c.digest, "weight": w} for c, w in ref.mixture]
    return doc


def adapter_from_json(doc: Any, what: str = "'adapter'") -> AdapterRef | None:
    if doc is None:
        return None
    doc = _object(doc, what)
    _no_unknown(doc, {"name", "digest", "mixture"}, what)
    name, digest = doc.get("name"), doc.get("digest")
    if not isinstance(name, str) or not name or not isinstance(digest, str) or not digest.startswith("sha256:"):
        raise InvalidRequestError(f"{what} must be {{\"name\": str, \"digest\": \"sha256:...\"}}")
    if "mixture" not in doc:
        return AdapterRef(name, digest)
    parts = doc["mixture"]
    if not isinstance(parts, list) or not 0 < len(parts) <= MAX_COMPONENTS:
        raise InvalidRequestError(f"{what}'s mixture must list 1 to {MAX_COMPONENTS} components")
    refs = []
    for part in parts:
        part = dict(_object(part, f"{what}'s mixture component"))
        weight = part.pop("weight", None)
        if not _is_number(weight):
            raise InvalidRequestError(f"{what}'s mixture components need a numeric weight")
        refs.append((adapter_from_json(part, f"{what}'s mixture component"), float(weight)))
    ref = mixture_ref(refs)
    if (ref.name, ref.digest) != (name, digest):  # one definition of a mixture's identity: the engine's
        raise InvalidRequestError(f"{what} names mixture {name!r} ({digest}), but its components make "
                                  f"{ref.name!r} ({ref.digest})")
    return ref


# Each SamplingParams field's JSON type: what the value must be before the dataclass checks ranges.
_FLOATS = ("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p")
_INTS = ("max_tokens", "top_k", "min_tokens")


def sampling_to_json(sp: SamplingParams) -> dict[str, Any]:
    doc = dataclasses.asdict(sp)
    doc["stop"], doc["stop_token_ids"] = list(sp.stop), list(sp.stop_token_ids)
    doc["logit_bias"] = [[t, b] for t, b in sp.logit_bias]
    so = sp.structured_output
    doc["structured_output"] = None if so is None else {"kind": so.kind, "spec": so.spec, "strict": so.strict}
    return doc


def sampling_from_json(doc: Any) -> SamplingParams:
    doc = _object(doc, "'sampling'")
    _no_unknown(doc, {f.name for f in dataclasses.fields(SamplingParams)}, "'sampling'")
    for k in _FLOATS:
        if k in doc and not _is_number(doc[k]):
            raise InvalidRequestError(f"'sampling.{k}' must be a number")
    for k in _INTS:
        if k in doc and not _is_int(doc[k]):
            raise InvalidRequestError(f"'sampling.{k}' must be an integer")
    for k in ("seed", "logprobs"):
        if doc.get(k) is not None and not _is_int(doc[k]):
            raise InvalidRequestError(f"'sampling.{k}' must be an integer or null")
    if "ignore_eos" in doc and not isinstance(doc["ignore_eos"], bool):
        raise InvalidRequestError("'sampling.ignore_eos' must be true or false")
    kw = dict(doc)
    kw["stop"] = tuple(_list_of(doc.get("stop", []), str, "stop"))
    kw["stop_token_ids"] = tuple(_list_of(doc.get("stop_token_ids", []), int, "stop_token_ids"))
    kw["logit_bias"] = tuple(tuple(p) for p in _list_of(doc.get("logit_bias", []), list, "logit_bias"))
    kw["structured_output"] = _structured(doc.get("structured_output"))
    return SamplingParams(**kw)


def _structured(doc: Any) -> StructuredOutput | None:
    if doc is None:
        return None
    doc = _object(doc, "'sampling.structured_output'")
    kind, spec, strict = doc.get("kind"), doc.get("spec", ""), doc.get("strict", False)
    if kind not in ("json_object", "json_schema", "tool_call") or not isinstance(spec, str) \
            or not isinstance(strict, bool):
        raise InvalidRequestError("'sampling.structured_output' must be {kind, spec: str, strict: bool}")
    if kind == "json_object":
        return StructuredOutput.json_object()
    try:
        doc = orjson.loads(spec)
    except orjson.JSONDecodeError:
        raise InvalidRequestError("'sampling.structured_output.spec' is not JSON") from None
    # Rebuilt through the gateway's own constructors: the same refusals, whoever sent it.
    if kind == "json_schema":
        return StructuredOutput.json_schema(doc, strict)
    functions = doc.get("functions") if isinstance(doc, Mapping) else None
    parallel = doc.get("parallel") if isinstance(doc, Mapping) else None
    if not isinstance(functions, list) or not isinstance(parallel, bool):
        raise InvalidRequestError("a tool_call spec must be {\"functions\": [...], \"parallel\": bool}")
    tools = [{"type": "function", "function": f} for f in functions]
    return StructuredOutput.tool_call(tools, "required", parallel)


# -- outputs -----------------------------------------------------------------------------
def output_to_json(out: RequestOutput) -> dict[str, Any]:
    return {"type": "output", "new_token_ids": out.new_token_ids, "new_text": out.new_text,
            "finished": out.finished, "finish_reason": out.finish_reason,
            "num_prompt_tokens": out.num_prompt_tokens, "num_cached_tokens": out.num_cached_tokens,
            "num_output_tokens": out.num_output_tokens,
            "num_processed_prompt_tokens": out.num_processed_prompt_tokens,
            "logprobs": [[lp, [list(p) for p in top]] for lp, top in out.logprobs],
            "stop_reason": out.stop_reason, "index": out.index,
            "prompt_logprobs": None if out.prompt_logprobs is None else
            [None if e is None else [e[0], [list(p) for p in e[1]]] for e in out.prompt_logprobs],
            "queue_time": out.queue_time, "prefill_time": out.prefill_time}


def output_from_json(request_id: str, doc: Mapping[str, Any]) -> RequestOutput:
    """A RequestOutput from one `output` line (the worker wrote it: trusted, not re-checked)."""
    return RequestOutput(
        request_id=request_id, new_token_ids=list(doc["new_token_ids"]), new_text=doc["new_text"],
        finished=doc["finished"], finish_reason=doc.get("finish_reason"),
        num_prompt_tokens=doc.get("num_prompt_tokens", 0), num_cached_tokens=doc.get("num_cached_tokens", 0),
        num_output_tokens=doc.get("num_output_tokens", 0),
        num_processed_prompt_tokens=doc.get("num_processed_prompt_tokens", 0),
        logprobs=[(lp, [(int(t), v) for t, v in top]) for lp, top in doc.get("logprobs", [])],
        stop_reason=doc.get("stop_reason"), index=doc.get("index", 0),
        prompt_logprobs=None if doc.get("prompt_logprobs") is None else
        [None if e is None else (e[0], [(int(t), v) for t, v in e[1]]) for e in doc["prompt_logprobs"]],
        queue_time=doc.get("queue_time"), prefill_time=doc.get("prefill_time"))


def coalesce_choices(outs: Sequence[RequestOutput]) -> list[RequestOutput]:
    """Consecutive outputs joined per run of one choice (n > 1 interleaves choices)."""
    runs: list[list[RequestOutput]] = []
    for out in outs:
        if runs and runs[-1][-1].index == out.index and not runs[-1][-1].finish_reason:
            runs[-1].append(out)
        else:
            runs.append([out])
    return [coalesce(run) for run in runs]


def coalesce(outs: Sequence[RequestOutput]) -> RequestOutput:
    """Several consecutive outputs of one request as one (deltas joined, counts the last's)."""
    if len(outs) == 1:
        return outs[0]
    last = outs[-1]
    return dataclasses.replace(
        last, new_token_ids=[t for o in outs for t in o.new_token_ids], new_text="".join(o.new_text for o in outs),
        logprobs=[lp for o in outs for lp in o.logprobs],
        prompt_logprobs=next((o.prompt_logprobs for o in outs if o.prompt_logprobs is not None), None),
        queue_time=next((o.queue_time for o in outs if o.queue_time is not None), None),
        prefill_time=next((o.prefill_time for o in outs if o.prefill_time is not None), None))


def dumps_line(doc: Mapping[str, Any]) -> bytes:
    return orjson.dumps(doc) + b"\n"


# -- validation helpers ------------------------------------------------------------------
def _object(doc: Any, what: str) -> Mapping[str, Any]:
    if not isinstance(doc, Mapping):
        raise InvalidRequestError(f"{what} must be a JSON object")
    return doc


def _no_unknown(doc: Mapping[str, Any], known: set[str], what: str) -> None:
    unknown = sorted(set(doc) - known)
    if unknown:
        raise InvalidRequestError(f"{what} has unknown fields: {', '.join(map(repr, unknown[:5]))}")


def _str(doc: Mapping[str, Any], key: str) -> str:
    v = doc.get(key, "")
    if not isinstance(v, str):
        raise InvalidRequestError(f"'{key}' must be a string")
    return v


def _is_int(v: Any) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _list_of(v: Any, kind: type, key: str) -> list:
    ok = isinstance(v, list) and all(_is_int(x) if kind is int else isinstance(x, kind) for x in v)
    if not ok:
        raise InvalidRequestError(f"'sampling.{key}' must be a list of {kind.__name__}")
    return v


__all__ = [
    "NDJSON",
    "STATS_HEADER",
    "TOKEN_ENV",
    "GenerateRequest",
    "adapter_from_json",
    "coalesce",
    "coalesce_choices",
    "dumps_line",
    "output_from_json",
    "output_to_json",
    "sampling_from_json",
    "sampling_to_json",
]
