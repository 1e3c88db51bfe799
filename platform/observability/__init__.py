"""Observability building blocks: request ids, JSON logs, OpenTelemetry tracing, metrics.

Each piece is usable on its own; the gateway and engine wire them in.
"""
