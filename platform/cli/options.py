"""Option groups several `loraplex` commands share (serve, gateway and worker: log format
and tracing; serve and gateway: request timeout, listener limits), and the argument types
they parse with."""
from __future__ import annotations

import argparse
import json
import re
from dataclasses import fields

from loraplex.engine.config import SpeculativeConfig
from loraplex.platform.serving.gaie import parse_objective
from loraplex.platform.settings import DEFAULT_ADAPTER_CACHE_BYTES, AdminConfig, AuthConfig, ServerLimits, UsageConfig

# What clears a limit or a timeout on the command line.
CLEAR = ("none", "off", "unlimited", "clear")

_SIZE_RE = re.compile(r"^\s*([0-9.]+(?:e[0-9]+)?)\s*([kmgt]?i?b?)?\s*$", re.I)
_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "ki": 1024, "kib": 1024, "m": 1e6, "mb": 1e6, "mi": 2**20,
          "mib": 2**20, "g": 1e9, "gb": 1e9, "gi": 2**30, "gib": 2**30, "t": 1e12, "tb": 1e12, "ti": 2**40,
          "tib": 2**40}


def parse_size(text: str) -> int:
    """'2GiB', '512MiB', '1e9', '1073741824' -> bytes."""
    m = _SIZE_RE.match(text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 2GiB, 512MiB or a number of bytes)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def cache_size_arg(text: str) -> int | None:
    """A cache bound: a size > 0 as `parse_size` reads it, or none/off/unlimited (None)."""
    if text.strip().lower() in CLEAR:
        return None
    size = parse_size(text)
    if size <= 0:
        raise argparse.ArgumentTypeError(f"a cache size must be > 0, got {text!r} (or 'none' for no bound)")
    return size


def adapter_cache_option(p: argparse.ArgumentParser) -> None:
    """--adapter-cache-size: `serve` and `worker` bound the local cache of adapter versions
    fetched from a remote shared store."""
    p.add_argument("--adapter-cache-size", type=cache_size_arg, default=DEFAULT_ADAPTER_CACHE_BYTES, metavar="SIZE",
                   help="disk the adapter versions fetched from a remote adapter store may take in the local "
                        "cache, e.g. 20GiB: past it the least recently used ones not being loaded are removed "
                        f"(fetched again when next used); 'none': no bound (default {DEFAULT_ADAPTER_CACHE_BYTES >> 30}GiB)")


def seconds_arg(text: str) -> float:
    """Seconds > 0, or none/off/clear (0: the server's default)."""
    if text.strip().lower() in CLEAR:
        return 0.0
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r} (or 'none' to clear it)") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"seconds must be a finite number >= 0, got {text!r}")
    return value


def serving_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("requests and observability")
    g.add_argument("--request-timeout", type=seconds_arg, default=0.0, metavar="S",
                   help="seconds a request may run before the engine ends it (finish reason timeout; a tenant's "
                        "own --request-timeout wins); default none")
    observability_options(g)


def observability_options(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """--log-format and --otlp-endpoint: every role that serves requests takes both, so a
    request's id is on the gateway's and the worker's lines alike."""
    if isinstance(p, argparse.ArgumentParser):
        p = p.add_argument_group("observability")
    p.add_argument("--log-format", choices=("text", "json"), default="text",
                   help="log lines as text or as one JSON object each (with the request id)")
    p.add_argument("--otlp-endpoint", default=None, metavar="URL",
                   help="send OpenTelemetry traces here (OTLP/HTTP, e.g. http://collector:4318/v1/traces); "
                        "default off")


def server_options(p: argparse.ArgumentParser) -> None:
    d = ServerLimits()
    g = p.add_argument_group("limits (see the README's \"Limits\")")
    g.add_argument("--metrics-host", default="127.0.0.1", help="/metrics listener's address (default loopback)")
    g.add_argument("--metrics-port", type=int, default=9464,
                   help="/metrics on this port of its own (default 9464); 0: on the main port")
    g.add_argument("--forwarded-allow-ips", default="127.0.0.1", metavar="IPS",
                   help="proxies trusted for X-Forwarded-For/-Proto: addresses or CIDR ranges, comma-separated, "
                        "or '*'")
    g.add_argument("--auth-failure-burst", type=int, default=AuthConfig.failure_burst, metavar="N",
                   help="failed authentications one address may make in a burst before 429 (valid keys "
                        "are always served)")
    g.add_argument("--auth-failure-rate", type=float, default=AuthConfig.failure_rate, metavar="PER_S",
                   help="failed authentications per second an address earns back after its burst")
    g.add_argument("--secure-cookies", action="store_true",
                   help="mark the admin session cookie Secure on every request (behind a TLS-terminating proxy)")
    g.add_argument("--usage-drain-timeout", type=float, default=UsageConfig.drain_seconds, metavar="S",
                   help="at shutdown, seconds to keep writing the usage journal's events to the database "
                        "(what is left stays in the journal; default 10)")
    g.add_argument("--header-timeout", type=float, default=d.header_timeout, metavar="S",
                   help="seconds to send a request's headers")
    g.add_argument("--body-timeout", type=float, default=d.body_timeout, metavar="S",
                   help="seconds to send a request body, plus one per --body-min-rate bytes sent")
    g.add_argument("--body-min-rate", type=parse_size, default=d.body_min_rate, metavar="SIZE",
                   help="bytes per second of request body that earn one more second (default 8KiB)")
    g.add_argument("--keep-alive-timeout", type=int, default=d.keep_alive_timeout, metavar="S")
    g.add_argument("--max-connections", type=int, default=d.max_connections, metavar="N",
                   help="connections + requests in progress; past it, 503 (never to /health, /ready)")
    g.add_argument("--max-connections-per-client", type=int, default=d.max_connections_per_client, metavar="N",
                   help="connections from one address (trusted proxies excepted); past it, 429")
    g.add_argument("--send-buffer", type=parse_size, default=d.send_buffer_bytes, metavar="SIZE",
                   help="kernel send buffer per connection: a stream whose client stops reading backs up into "
                        "the engine, which pauses it (default 64KiB)")
    g.add_argument("--stream-send-buffer", type=parse_size, default=d.stream_send_buffer_bytes, metavar="SIZE",
                   help="the same while a response streams: a client that stops reading is found after this "
                        "much, and its request paused (default 16KiB)")
    g.add_argument("--refusal-hold", type=float, default=d.refusal_hold, metavar="S",
                   help="seconds a 429 is held before it is sent, at most its Retry-After: a client flooding "
                        "refusals gets one per connection per hold (default 1; 0 answers at once)")
    g.add_argument("--max-body-size", type=parse_size, default=d.max_body_bytes, metavar="SIZE",
                   help="request bodies of the OpenAI routes (default 4MiB)")
    g.add_argument("--max-body-rate", type=parse_size, default=d.body_bytes_per_second, metavar="SIZE",
                   help="request body bytes per second one tenant may send, past a burst of one "
                        "--max-body-size body; past it, 429 (default 1MiB)")
    g.add_argument("--max-upload-size", type=parse_size, default=AdminConfig.max_upload_bytes, metavar="SIZE",
                   help="adapter uploads through the admin API (default 1GiB)")
    p.add_argument("--inference-objective", action="append", type=objective_arg, default=[],
                   metavar="NAME=LANE|PRIORITY",
                   help="a GAIE InferenceObjective (x-gateway-inference-objective) as a lane, or as its GAIE "
                        "priority (>0 interactive, 0 standard, <0 batch); repeatable")


def server_settings(args: argparse.Namespace) -> dict:
    limits = ServerLimits(header_timeout=args.header_timeout, body_timeout=args.body_timeout,
                          body_min_rate=args.body_min_rate, keep_alive_timeout=args.keep_alive_timeout,
                          max_connections=args.max_connections,
                          max_connections_per_client=args.max_connections_per_client,
                          refusal_hold=args.refusal_hold, send_buffer_bytes=args.send_buffer,
                          stream_send_buffer_bytes=args.stream_send_buffer,
                          max_body_bytes=args.max_body_size, body_bytes_per_second=args.max_body_rate)
    return {"limits": limits, "metrics_host": args.metrics_host, "metrics_port": args.metrics_port or None,
            "forwarded_allow_ips": args.forwarded_allow_ips,
            "admin": AdminConfig(max_upload_bytes=args.max_upload_size),
            "auth": AuthConfig(failure_burst=args.auth_failure_burst, failure_rate=args.auth_failure_rate),
            "secure_cookies": args.secure_cookies, "usage": UsageConfig(drain_seconds=args.usage_drain_timeout),
            "inference_objectives": tuple(args.inference_objective)}


def objective_arg(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name.strip() or not value.strip():
        raise argparse.ArgumentTypeError(f"--inference-objective takes NAME=LANE|PRIORITY, got {text!r}")
    try:
        parse_objective(value.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--inference-objective: {exc}") from None
    return name.strip(), value.strip()


def lora_module_arg(text: str) -> tuple[str, str, str | None]:
    """One of vLLM's `--lora-modules`: NAME=PATH, or the JSON form
    {"name": ..., "path": ..., "base_model_name": ...} -> (name, path, base model or None)."""
    if text.lstrip().startswith("{"):
        try:
            doc = json.loads(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"--lora-modules: not valid JSON: {text!r}") from None
        name, path, base = doc.get("name"), doc.get("path"), doc.get("base_model_name")
        unknown = sorted(set(doc) - {"name", "path", "base_model_name"})
        if unknown or not isinstance(name, str) or not name or not isinstance(path, str) or not path \
                or not (base is None or isinstance(base, str)):
            raise argparse.ArgumentTypeError(
                '--lora-modules takes NAME=PATH or {"name": ..., "path": ..., "base_model_name": ...}, '
                f"got {text!r}")
        return name, path, base
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"--lora-modules takes NAME=PATH (or its JSON form), got {text!r}")
    return name, path, None


def lora_modules_option(p: argparse.ArgumentParser) -> None:
    """vLLM's spelling of `--adapter`, so a vLLM launch line ports over."""
    p.add_argument("--lora-modules", nargs="+", action="extend", type=lora_module_arg, default=[],
                   metavar="NAME=PATH|JSON",
                   help="vLLM's form of --adapter: NAME=PATH or '{\"name\": ..., \"path\": ..., "
                        "\"base_model_name\": ...}', several after one flag")


def adapters_from_args(args: argparse.Namespace, model_names: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """--adapter and --lora-modules together; a module for another base model, or a name
    given twice, is a ValueError."""
    out = list(getattr(args, "adapter", []) or [])
    for name, path, base in getattr(args, "lora_modules", []) or []:
        if base is not None and base not in model_names:
            raise ValueError(f"--lora-modules {name}: base_model_name {base!r} is not the model served here "
                             f"({', '.join(repr(n) for n in model_names)})")
        out.append((name, path))
    names = [n for n, _ in out]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"adapter {twice[0]!r} is given twice (--adapter / --lora-modules)")
    return tuple(out)


def speculative_config_arg(text: str) -> SpeculativeConfig:
    """--speculative-config's JSON object -> SpeculativeConfig, or an error naming the problem."""
    try:
        raw = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(raw, dict):
        raise argparse.ArgumentTypeError("expected a JSON object such as {\"method\": \"ngram\"}")
    known = {f.name for f in fields(SpeculativeConfig)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown keys {unknown}; known: {sorted(known)}")
    try:
        return SpeculativeConfig(**raw)
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None
