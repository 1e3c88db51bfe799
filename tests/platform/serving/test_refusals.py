"""The refusal hold: a 429 waits min(hold, its Retry-After) before it is sent; nothing else
waits, and the held answers show in the gateway's gauge while they wait."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import httpx
from prometheus_client import CollectorRegistry, Gauge
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from loraplex.platform.serving.refusals import RefusalHold


def _app(retry_after: str | None) -> Starlette:
    async def refuse(request):
        headers = {"Retry-After": retry_after} if retry_after is not None else {}
        return PlainTextResponse("no", 429, headers=headers)

    async def serve(request):
        return PlainTextResponse("yes")

    app = Starlette(routes=[Route("/refuse", refuse), Route("/serve", serve)])
    gauge = Gauge("loraplex:refusals_held", "held", registry=CollectorRegistry())
    app.state.gateway = SimpleNamespace(metrics=SimpleNamespace(refusals_held=gauge))
    return app


def _run(app: Starlette, hold: float, paths: list[str]) -> tuple[list[int], list[float], list[float]]:
    """Statuses, the holds slept, and the gauge as each hold began."""
    slept, gauge_seen = [], []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)
        gauge_seen.append(app.state.gateway.metrics.refusals_held._value.get())

    wrapped = RefusalHold(app, hold, sleep=sleep)

    async def main() -> list[int]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=wrapped), base_url="http://t") as client:
            return [(await client.get(p)).status_code for p in paths]

    return asyncio.run(main()), slept, gauge_seen


def test_a_429_is_held_up_to_its_retry_after_and_nothing_else_is():
    statuses, slept, seen = _run(_app("7"), 1.5, ["/serve", "/refuse", "/serve", "/refuse"])
    assert statuses == [200, 429, 200, 429] and slept == [1.5, 1.5] and seen == [1.0, 1.0]
    assert _run(_app("1"), 5.0, ["/refuse"])[1] == [1.0], "never past the Retry-After"
    assert _run(_app(None), 5.0, ["/refuse"])[1] == [1.0], "no Retry-After: a second"
    assert _run(_app("7"), 0.0, ["/refuse"])[:2] == ([429], []), "hold 0: answered at once"
