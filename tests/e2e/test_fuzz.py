"""Fuzzing both APIs from their own OpenAPI documents (schemathesis strategies, seeded
and bounded): whatever a client sends, no 5xx, and every error is a JSON error body
that shows no traceback, exception repr or server path.

Inputs that fit the schema and inputs that do not (schemathesis's negative mode) are
both sent. Generation lengths are clamped to a few tokens so the examples stay quick.
"""
from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import schemathesis
import torch
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.core import NOT_SET

from loraplex.platform.admin.routes import openapi as admin_openapi
from loraplex.platform.serving.openapi import openai_openapi
from tests.e2e.admin_fixtures import ADMIN_TOKEN, admin_live  # noqa: F401 - fixtures

REPO = Path(__file__).resolve().parents[2]
MODES = (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
OPENAI_SCHEMA = schemathesis.openapi.from_dict(openai_openapi())
ADMIN_SCHEMA = schemathesis.openapi.from_dict(admin_openapi())
_CLAMP = {"max_tokens": 4, "max_completion_tokens": 4, "min_tokens": 4, "n": 2}


@pytest.fixture(autouse=True)
def _subnormal_floats():
    # Loading the C kernels (built with fast math) turns flush-to-zero on for the loading
    # thread; Hypothesis needs subnormal floats to generate numbers. The flag is per
    # thread, so the engine's own thread keeps its setting.
    torch.set_flush_denormal(False)


def _fuzz(examples: int):
    return settings(max_examples=examples, derandomize=True, deadline=None, database=None,
                    suppress_health_check=list(HealthCheck))


def _cases(schema) -> list[tuple[str, str, GenerationMode]]:
    """(path, method, mode) of every operation; negative mode only where there is input."""
    out = []
    for op in (r.ok() for r in schema.get_all_operations()):
        has_input = any(len(list(x)) for x in (op.body, op.path_parameters, op.query, op.headers))
        out += [(op.path, op.method.upper(), mode) for mode in MODES if has_input or mode.is_positive]
    return out


def _clamped(body):
    if isinstance(body, dict):
        return {k: (min(v, _CLAMP[k]) if k in _CLAMP and isinstance(v, int) and not isinstance(v, bool) else v)
                for k, v in body.items()}
    return body


def _send(client: httpx.Client, case, headers: dict[str, str]) -> httpx.Response:
    # The credentials are ours; other generated headers go as long as HTTP can carry them.
    sendable = {k: v for k, v in (case.headers or {}).items() if k.lower() != "authorization"
                and isinstance(v, str) and v.isascii() and v.isprintable() and v == v.strip()}
    kw: dict = {"params": case.query or None, "headers": {**sendable, **headers}}
    body = _clamped(case.body)
    if isinstance(body, (bytes, bytearray)):
        kw["content"] = bytes(body)
    elif body is not NOT_SET:
        if case.media_type == "multipart/form-data" and isinstance(body, dict):
            kw["files"] = {k: (k, v if isinstance(v, bytes) else str(v).encode()) for k, v in body.items()}
        elif case.media_type in (None, "application/json"):
            kw["content"] = json.dumps(body, default=repr).encode()
            kw["headers"].setdefault("content-type", "application/json")
        else:
            kw["content"] = str(body).encode()
    return client.request(case.method, case.formatted_path, **kw)


def check_answer(r: httpx.Response, where: str) -> None:
    """No 5xx; an error is a JSON error body leaking nothing of the server."""
    assert r.status_code < 500, f"{where} -> {r.status_code}: {r.text[:500]}"
    if r.status_code < 400:
        return
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str), r.text
    for leak in ("Traceback", " object at 0x", "site-packages", str(REPO), "/tmp/"):
        assert leak not in r.text, f"{where} -> {r.status_code} leaks {leak!r}: {r.text[:500]}"


def fuzz_operation(url: str, op, mode: GenerationMode, token: str, examples: int) -> None:
    with httpx.Client(base_url=url, timeout=60) as client:
        headers = {"authorization": f"Bearer {token}"}

        @_fuzz(examples)
        @given(case=op.as_strategy(generation_mode=mode))
        def run(case):
            check_answer(_send(client, case, headers), f"{case.method} {case.path} {case.body!r:.200}")

        run()


@pytest.mark.parametrize("path,method,mode", _cases(OPENAI_SCHEMA))
def test_openai_routes(live, path, method, mode):
    fuzz_operation(live.url, OPENAI_SCHEMA[path][method], mode, live.keys["acme"], 40)


@pytest.mark.parametrize("path,method,mode", _cases(ADMIN_SCHEMA))
def test_admin_api(admin_live, path, method, mode):  # noqa: F811
    fuzz_operation(admin_live.url, ADMIN_SCHEMA[path][method], mode, ADMIN_TOKEN, 8)


def test_admin_inputs_the_database_cannot_store_are_400s(admin_live):  # noqa: F811
    """What the fuzzer found on PostgreSQL: integers past the columns' range, NUL characters."""
    cases = [("POST", "/admin/api/tenants", {"json": {"name": "big", "quotas": {"rpm": 2**40}}}, "quotas.rpm"),
             ("GET", "/admin/api/audit", {"params": {"before": 2**40}}, "before"),
             ("GET", "/admin/api/tenants/a%00b", {}, "name"),
             ("GET", "/admin/api/keys", {"params": {"tenant": "a\x00"}}, "tenant")]
    with httpx.Client(base_url=admin_live.url, timeout=60,
                      headers={"authorization": f"Bearer {ADMIN_TOKEN}"}) as client:
        for method, path, kw, param in cases:
            r = client.request(method, path, **kw)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (path, r.text)
