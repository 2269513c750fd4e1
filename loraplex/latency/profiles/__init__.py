"""Shipped latency profiles (JSON), found by name: `--profile cpu-tiny`."""
