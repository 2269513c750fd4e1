"""`loraplex agent --backend vllm`: the agent beside an unmodified vLLM OpenAI server.

The agent gives a vLLM server the pool's cluster face (registration, heartbeats, residency and queue
depth from vLLM's metrics, adapters fetched through the distributed adapter pool and loaded through
vLLM's runtime LoRA endpoints); the router sends requests to the vLLM server itself. See docs/vllm.md.
"""
