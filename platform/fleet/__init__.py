"""The gateway side of scale-out: an `EngineClient` over the engine workers' internal API
(platform/fleet/WIRE.md), with `platform.routing` choosing the worker for every request."""
