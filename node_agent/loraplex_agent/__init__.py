"""The node agent: its HTTP surface (api/), the torch runtime (runtime/), the adapter store (adapters/),
pool membership (cluster/), the vLLM sidecar (vllm_backend/) and tools; cli.py is the entry."""
