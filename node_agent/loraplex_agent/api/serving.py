"""What completions and chat share: model names, prompts, sampling parameters, SSE framing."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pydantic import BaseModel
from tokenizers import pre_tokenizers

from loraplex.engine.output.sampling import SamplingParams
from loraplex.engine.request import SampledToken
from loraplex.spec.errors import InvalidRequestError, LoraplexError, NotFoundError
from loraplex_agent.api.generation import GenerationJob
from loraplex_agent.api.metrics import ServerMetrics
from loraplex_agent.api.openai_protocol import ChatMessage, PromptLogprob, PromptLogprobs, _SamplingFields
from loraplex_agent.runtime.async_engine import AsyncEngine

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

SSE_DONE = "data: [DONE]\n\n"


@dataclass
class ServingContext:
    engine: AsyncEngine
    metrics: ServerMetrics
    served_model_name: str
    model_path: str
    # A prompt text longer than this (in UTF-8 bytes) cannot fit in max_model_len tokens, so it is
    # refused without tokenizing it; None when the tokenizer gives no exact bound (prompt_byte_limit).
    max_prompt_bytes: int | None = None

    @property
    def tokenizer(self):
        return self.engine.llm.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def resolve_model(self, model: str) -> str | None:
        """The adapter a request's `model` names, or None for the base model."""
        if model == self.served_model_name:
            return None
        if model in self.engine.adapters:
            return model
        raise NotFoundError(f"the model {model!r} does not exist", param="model", code="model_not_found")

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            self.check_prompt_bytes(prompt, "prompt")
            return self.tokenizer.encode(prompt)
        vocab = self.engine.llm.model_config.vocab_size
        bad = next((t for t in prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(f"token id {bad} is outside the vocabulary (0..{vocab - 1})",
                                      param="prompt")
        return list(prompt)

    def render_chat(self, messages: list[ChatMessage]) -> list[int]:
        """The chat template of the tokenizer, ending with the assistant's turn to speak."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise InvalidRequestError("this model's tokenizer has no chat template; use /v1/completions",
                                      param="messages")
        conversation = [{"role": m.role, "content": m.text()} for m in messages]
        try:
            text = self.tokenizer.apply_chat_template(conversation, add_generation_prompt=True,
                                                      tokenize=False)
        except Exception as exc:  # the template itself rejects the conversation (jinja raise_exception)
            raise InvalidRequestError(f"the chat template rejected the messages: {exc}",
                                      param="messages") from exc
        self.check_prompt_bytes(text, "messages")
        return self.tokenizer.encode(text, add_special_tokens=False)

    def check_prompt_bytes(self, text: str, param: str) -> None:
        """Refuse, before tokenizing it, a prompt too long in bytes to fit in the context."""
        limit = self.max_prompt_bytes
        if limit is None or 4 * len(text) <= limit:  # a character is at most 4 UTF-8 bytes
            return
        size = len(text.encode("utf-8", "surrogatepass"))
        if size > limit:
            raise InvalidRequestError(
                f"this model's maximum context length is {self.max_model_len} tokens, but the prompt has "
                f"{size} bytes, more than {limit} bytes (what {self.max_model_len} tokens of this "
                "tokenizer can hold at most)", param=param, code="context_length_exceeded")

    def sampling_params(self, req: _SamplingFields, num_prompt_tokens: int, max_tokens: int | None,
                        logprobs: int | None, prompt_param: str, prompt_logprobs: int | None = None) -> SamplingParams:
        room = self.max_model_len - num_prompt_tokens
        if room < 1:
            raise InvalidRequestError(
                f"this model's maximum context length is {self.max_model_len} tokens, but the prompt "
                f"has {num_prompt_tokens} tokens", param=prompt_param,
                code="context_length_exceeded")
        if max_tokens is not None and max_tokens > room:
            raise InvalidRequestError(
                f"this model's maximum context length is {self.max_model_len} tokens; you asked for "
                f"{num_prompt_tokens + max_tokens} ({num_prompt_tokens} in the prompt, {max_tokens} in "
                "the output)", param="max_tokens", code="context_length_exceeded")
        return SamplingParams(
            max_tokens=room if max_tokens is None else max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k or 0, seed=req.seed,
            stop=req.stop_strings(), stop_token_ids=tuple(req.stop_token_ids or ()),
            ignore_eos=req.ignore_eos, logprobs=logprobs, min_tokens=req.min_tokens,
            presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            logit_bias=req.logit_bias_pairs(self.engine.llm.model_config.vocab_size),
            json_object=req.json_object, prompt_logprobs=prompt_logprobs)

    def job(self, prefix: str, prompt_token_ids: list[int], sampling: SamplingParams,
            adapter: str | None) -> GenerationJob:
        return GenerationJob(f"{prefix}-{uuid.uuid4().hex}", prompt_token_ids, sampling, adapter,
                             self.engine.llm.eos_token_ids)

    def shares_prefill(self, num_prompt_tokens: int) -> bool:
        """Whether sibling sequences can start from one prefill of their prompt: the memory policy
        keeps a prefix cache and the prompt has at least one full block before its last token."""
        core = self.engine.core
        return bool(getattr(core.memory, "keeps_prefixes", False)) and num_prompt_tokens > core.config.block_size

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False,
                                     clean_up_tokenization_spaces=False)

    def prompt_logprobs(self, entries: list[SampledToken | None] | None) -> PromptLogprobs | None:
        """vLLM's `prompt_logprobs`: per prompt token, its entry and the top k by token id."""
        if entries is None:
            return None
        return [None if entry is None else self._prompt_entry(entry) for entry in entries]

    def _prompt_entry(self, entry: SampledToken) -> dict[str, PromptLogprob]:
        scored = {str(entry.token_id): PromptLogprob(logprob=entry.logprob, rank=entry.rank,
                                                     decoded_token=self.token_text(entry.token_id))}
        for rank, (token_id, logprob) in enumerate(entry.top_logprobs or [], start=1):
            scored.setdefault(str(token_id), PromptLogprob(logprob=logprob, rank=rank,
                                                           decoded_token=self.token_text(token_id)))
        return scored


def prompt_byte_limit(tokenizer: PreTrainedTokenizerBase, max_model_len: int) -> int | None:
    """max_model_len x the most bytes one token stands for: a longer prompt has more tokens than
    the context holds. None unless that is exact (see `longest_token_bytes`)."""
    longest = longest_token_bytes(tokenizer)
    return None if longest is None else max_model_len * longest


def longest_token_bytes(tokenizer: PreTrainedTokenizerBase) -> int | None:
    """The most UTF-8 bytes of text one token can cover, for a byte-level BPE tokenizer (GPT-2,
    Llama 3, the tiny model) that keeps every byte of the text: no normalizer, no pre-tokenizer
    step that drops text, no added token that swallows the spaces around it. None otherwise."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    spec = json.loads(backend.to_str())
    model, added = spec.get("model") or {}, spec.get("added_tokens") or []
    if (spec.get("normalizer") is not None or model.get("type") != "BPE"
            or not _keeps_every_byte(spec.get("pre_tokenizer"))
            or any(t.get("lstrip") or t.get("rstrip") for t in added)):
        return None
    specials = {t["content"] for t in added}
    alphabet = frozenset(pre_tokenizers.ByteLevel.alphabet())  # one character per byte
    vocab = [token for token in model.get("vocab") or {} if token not in specials]
    if not vocab or not all(alphabet.issuperset(token) for token in vocab):
        return None
    return max([len(token) for token in vocab] + [len(t.encode()) for t in specials])


def _keeps_every_byte(pre_tokenizer: dict | None) -> bool:
    """A ByteLevel pre-tokenizer, alone or in a sequence with splits that keep what they match."""
    if pre_tokenizer is None:
        return False
    steps = pre_tokenizer.get("pretokenizers", []) if pre_tokenizer.get("type") == "Sequence" else [pre_tokenizer]
    return (any(step.get("type") == "ByteLevel" for step in steps)
            and all(step.get("type") in _KEEPING_STEPS and step.get("behavior") != "Removed" for step in steps))


_KEEPING_STEPS = frozenset({"ByteLevel", "Split", "Digits", "Punctuation"})  # unless behavior is Removed


def sse(payload: BaseModel | dict) -> str:
    body = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {body}\n\n"


def sse_error(exc: BaseException) -> str:
    """An error after the stream started: the status is already sent, so it travels as an event."""
    error = exc if isinstance(exc, LoraplexError) else LoraplexError(f"internal error: {exc!r}")
    return sse(error.to_openai())
