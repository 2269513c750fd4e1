"""When a request is done, decided from token ids alone (stop strings are the frontend's job)."""

from __future__ import annotations

from loraplex.engine.request import FinishReason, Request


def finish_reason(request: Request, max_model_len: int) -> FinishReason | None:
    params = request.sampling
    num_output = len(request.output_token_ids)
    last = request.output_token_ids[-1]
    if num_output >= params.min_tokens:
        if not params.ignore_eos and last in request.eos_token_ids:
            return FinishReason.STOP
        if last in params.stop_token_ids:
            return FinishReason.STOP
    if num_output >= params.max_tokens or request.num_tokens >= max_model_len:
        return FinishReason.LENGTH
    return None
