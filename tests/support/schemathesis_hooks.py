"""Schemathesis hooks (loaded by the CLI through SCHEMATHESIS_HOOKS, see schemathesis_run.py).

A generated `model` is often replaced by one the server serves (LORAPLEX_FUZZ_MODELS, comma-separated),
so generated requests get past the model lookup and reach tokenizing, scheduling and generation; the
fields that set how much work a request is (output tokens, choices) are capped so that a bounded run
stays short on a CPU. Values that are invalid anyway (negative, wrong type) are left alone."""

from __future__ import annotations

import os
from typing import Any

import schemathesis
from hypothesis import strategies as st

CAPS = {"max_tokens": 8, "max_completion_tokens": 8, "min_tokens": 8, "n": 2, "best_of": 2}


def _capped(body: dict[str, Any], model: str) -> dict[str, Any]:
    out = {**body, "model": model}
    for key, cap in CAPS.items():
        value = out.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > cap:
            out[key] = cap
    if "messages" in out and out.get("max_tokens") is None and out.get("max_completion_tokens") is None:
        out["max_tokens"] = CAPS["max_tokens"]  # chat's default is "until the context is full"
    return out


@schemathesis.hook
def flatmap_body(context: Any, body: Any) -> st.SearchStrategy:
    models = [m for m in os.environ.get("LORAPLEX_FUZZ_MODELS", "").split(",") if m]
    if not models or not isinstance(body, dict) or not isinstance(body.get("model"), str):
        return st.just(body)
    return st.sampled_from([*models, body["model"]]).map(lambda model: _capped(body, model))
