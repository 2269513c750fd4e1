"""Defaults of what an agent accepts as an adapter source (import-light: the CLI reads them)."""

DEFAULT_SCHEMES = frozenset({"file", "https", "s3", "hf"})
DEFAULT_MAX_BYTES = 4 << 30
