"""Streaming tool-call parsing is linear: event-loop time per delta to parse one call fed
in many small deltas, for growing call lengths, as a ratio to the shortest call's.

A linear parser keeps the ratio near 1 as the call grows; a quadratic one (each delta
rescanning the call so far) grows it with the length (the parser this replaced took
34.8 s for 8,000 deltas of one unterminated name on a busy 2-core machine). Three
shapes: an unterminated function name, arguments without a closing brace, and a
well-formed call.

    python benchmarks/bench_tool_parser.py
    python benchmarks/bench_tool_parser.py --deltas 2000 8000 32000
"""
from __future__ import annotations

import argparse
import time

from loraplex.platform.serving.tool_parsers import HermesParser

SHAPES = {
    "unterminated name": ('<tool_call>{"name": "', "abcd", ""),
    "arguments, no brace": ('<tool_call>{"name": "f", "arguments": "', "abcd", ""),
    "well-formed call": ('<tool_call>{"name": "f", "arguments": {"k": "', "ab}c", '"}}</tool_call>'),
}


def _best(fn, repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _streamed(deltas: list[str]) -> None:
    p = HermesParser()
    for d in deltas:
        p.feed(d)
    p.finish()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--deltas", type=int, nargs="+", default=[1000, 4000, 16000])
    args = ap.parse_args()
    print(f"{'shape':<22}{'deltas':>8}{'seconds':>10}{'us/delta':>10}{'ratio':>7}")
    for name, (head, piece, tail) in SHAPES.items():
        base = None
        for n in sorted(args.deltas):
            deltas = [head] + [piece] * n + ([tail] if tail else [])
            seconds = _best(lambda: _streamed(deltas))
            per = seconds / n
            base = base or per
            print(f"{name:<22}{n:>8}{seconds:>10.4f}{per * 1e6:>10.1f}{per / base:>7.2f}")

if __name__ == "__main__":
    main()
