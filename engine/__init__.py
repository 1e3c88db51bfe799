"""loraplex engine: adapter-aware continuous batching over a paged KV pool."""
