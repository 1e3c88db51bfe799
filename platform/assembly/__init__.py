"""Assembly: the one place `serve` builds its in-process engine from settings
(`engine_factory.build_engine`), with the adapter source a replica sharing a registry and
an adapter store reads (`shared_adapters.RegistryAdapterSource`), and where quotas and
metering are composed into the gateway's hooks (`usage_hooks.UsageHooks`). Not serving:
the OpenAI routes take whatever `EngineClient` and hooks they are given."""
