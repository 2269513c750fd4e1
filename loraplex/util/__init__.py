"""The floor every layer of the core stands on: time (an injected clock), nothing above it."""
