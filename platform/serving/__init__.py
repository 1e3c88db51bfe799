"""The OpenAI-compatible API: the app, its routes, the wire format, streaming, key
authentication, Prometheus metrics and the gateway between them and the engine client."""
