"""The engine's step latency as a model of its batch: the step features, the fitted profile and the
shipped profiles. The twin runs on it, the rank-aware router scores with it, `loraplex profile` fits it."""
