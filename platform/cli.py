"""loraplex command line."""
from __future__ import annotations


def main() -> None:
    raise SystemExit("loraplex: not wired yet")

