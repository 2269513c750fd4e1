"""The adapter store: PEFT folders read and validated into host memory, and the registry of the
agent's adapters by name."""
