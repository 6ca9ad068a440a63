"""KV pools: the bytes a pool's blocks live in. Pools own memory, never policy."""
