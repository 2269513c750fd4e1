"""Where KV blocks and adapters live: the device page pool, the dependency tree (prefix cache), the
memory policies by name (`policies`: unified, lru-static, no-cache) and the seams schedulers use."""
