"""When a request is done, decided from token ids alone (stop strings are the frontend's job)."""

from __future__ import annotations

from loraplex.engine.request import NO_TOKEN, FinishReason, Request


def finish_reason(request: Request, max_model_len: int) -> FinishReason | None:
    """Runs once per generated token, hence the flat checks."""
    params = request.sampling
    output = request.output_token_ids
    num_output = len(output)
    last = output[-1]
    if last == NO_TOKEN:  # JSON mode found no token to continue with: cut short, like max_tokens
        return FinishReason.LENGTH
    if num_output >= params.min_tokens and (
            (last in request.eos_token_ids and not params.ignore_eos) or last in params.stop_token_ids):
        return FinishReason.STOP
    if num_output >= params.max_tokens or len(request.prompt_token_ids) + num_output >= max_model_len:
        return FinishReason.LENGTH
    return None
