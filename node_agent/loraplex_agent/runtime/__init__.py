"""The torch runtime: the engine thread, the offline LLM, the executor and its model, sampling, and
the device and host memory tiers (copies, pinned adapters, host KV, CPU-assisted LoRA)."""
