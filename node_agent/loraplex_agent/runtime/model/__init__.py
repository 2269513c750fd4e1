"""The base model: its shape (config.json), Llama layers, rotary embeddings, weights, and adapters laid out in device pages."""
