"""The Azure 2023 LLM inference traces the twin reads by default (data only; see README.md)."""
