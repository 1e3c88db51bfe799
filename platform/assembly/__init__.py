"""Engine assembly: the one place `serve` builds its in-process engine from settings
(`engine_factory.build_engine`), with the adapter source a replica sharing a registry and
an adapter store reads (`shared_adapters.RegistryAdapterSource`). Not serving: the OpenAI
routes take whatever `EngineClient` they are given."""
