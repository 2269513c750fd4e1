"""Commands beside serving: `loraplex make-tiny-model` and `loraplex profile`."""
