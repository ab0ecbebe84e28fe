"""Chunks and what holds them: the flat chunk with its shard (chunk.py), tensor states (states.py),
the cache of gathered chunks (cache.py), gradient staging buffers (staging.py) and pinned host
memory (host_memory.py)."""
