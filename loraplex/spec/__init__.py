"""Shared vocabulary: adapter identity, resource models and errors."""
