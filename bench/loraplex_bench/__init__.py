"""Benchmarks and load drivers: `loraplex bench ...` (see cli.py). Nothing in the project imports this."""
