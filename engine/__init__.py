"""loraplex engine: adapter-aware continuous batching over a paged KV pool."""
import os

# oneDNN caches one primitive per matmul shape, 1024 by default. A serving engine sees a
# new row count almost every step (decode widths, chunk sizes) times five weight shapes,
# so the default cache thrashes and every step re-creates its primitives: measured 5x
# slower for the same matmuls. Read when oneDNN first runs, so it is set at import.
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "16384")
