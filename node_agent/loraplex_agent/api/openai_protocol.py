"""Request and response bodies of the OpenAI-compatible API (and vLLM's adapter endpoints).

Unknown fields are ignored, as OpenAI and vLLM do. Fields we know but do not implement are
accepted only with their neutral value, so a client never gets a silently different answer
(docs/api.md).
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from loraplex.engine.output.sampling import MAX_TOP_LOGPROBS
from loraplex.spec.errors import InvalidRequestError

# ---- requests -------------------------------------------------------------------------------


class StreamOptions(BaseModel):
    include_usage: bool = False


MAX_CHOICES = 16  # the most sequences one request may ask for (`n`, `best_of`)


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str


class _SamplingFields(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="ignore")

    model: str
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    n: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # vLLM extension
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)  # vLLM extension
    user: str | None = None

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def include_usage_in_stream(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def json_object(self) -> bool:
        """JSON mode: the output must be one JSON object."""
        return self.response_format is not None and self.response_format.type == "json_object"

    @property
    def num_choices(self) -> int:
        return 1 if self.n is None else self.n

    @property
    def num_sequences(self) -> int:
        """Sequences generated for this request (more than the choices returned with best_of)."""
        return self.num_choices

    def check_supported(self) -> None:
        """Refuse what we would otherwise silently ignore."""
        _check_count(self.num_choices, "n")
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options is only allowed when stream is true",
                                      param="stream_options")
        if self.response_format is not None:
            _check_response_format(self.response_format.type)
        if self.prompt_logprobs is not None and self.stream:
            raise InvalidRequestError("prompt_logprobs is not available with stream", param="prompt_logprobs")

    def logit_bias_pairs(self, vocab_size: int) -> tuple[tuple[int, float], ...]:
        """`logit_bias` with its string keys read as token ids of the vocabulary."""
        pairs = []
        for key, bias in (self.logit_bias or {}).items():
            token = _token_id(key)
            if token is None or not 0 <= token < vocab_size:
                raise InvalidRequestError(f"logit_bias keys must be token ids between 0 and {vocab_size - 1}, "
                                          f"got {key!r}", param="logit_bias")
            pairs.append((token, bias))
        return tuple(pairs)


def _token_id(key: str) -> int | None:
    text = key.strip()
    return int(text) if text.isascii() and text.isdigit() else None


def _check_count(value: int, param: str) -> None:
    if not 1 <= value <= MAX_CHOICES:
        raise InvalidRequestError(f"{param} must be between 1 and {MAX_CHOICES}, got {value}", param=param)


def _check_response_format(kind: str) -> None:
    """`text`, and `json_object` (enforced: the output is one JSON object); `json_schema`, which
    promises a schema we do not check, is refused rather than silently weakened to json_object."""
    if kind == "json_schema":
        raise InvalidRequestError("response_format json_schema is not supported: only json_object is enforced "
                                  "(any JSON object); describe the schema in the prompt and validate the answer",
                                  param="response_format")
    if kind not in ("text", "json_object"):
        raise InvalidRequestError(f"response_format type must be text or json_object, got {kind!r}",
                                  param="response_format")


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @property
    def num_sequences(self) -> int:
        return self.num_choices if self.best_of is None else self.best_of

    def num_prompt_logprobs(self) -> int | None:
        """`prompt_logprobs`, else `logprobs` with `echo` (the echoed prompt's tokens get theirs)."""
        if self.prompt_logprobs is not None:
            return self.prompt_logprobs
        return self.logprobs if self.echo else None

    def check_supported(self) -> None:
        super().check_supported()
        if self.best_of is not None:
            _check_count(self.best_of, "best_of")
            if self.best_of < self.num_choices:
                raise InvalidRequestError(f"best_of must be at least n, got best_of={self.best_of} and "
                                          f"n={self.num_choices}", param="best_of")
            if self.stream and self.best_of > 1:
                raise InvalidRequestError("best_of cannot be used with stream", param="best_of")
        if self.suffix:
            raise InvalidRequestError("suffix is not supported", param="suffix")

    def single_prompt(self) -> str | list[int]:
        """The one prompt of this request: a string or a list of token ids."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise InvalidRequestError(
                    f"only one prompt per request is supported, got {len(prompt)}", param="prompt")
            prompt = prompt[0]
        if not prompt:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        return prompt


class TextContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise InvalidRequestError(f"content parts of type {part.type!r} are not supported; "
                                          "only text", param="messages")
            parts.append(part.text)
        return "".join(parts)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Any] | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs to be true", param="top_logprobs")
        if self.tools:
            raise InvalidRequestError("tools are not supported", param="tools")

    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class LoadLoraAdapterRequest(BaseModel):
    lora_name: str
    lora_path: str
    pinned: bool = False  # keep it on the device: loaded now, never evicted (as SGLang and vLLM users ask)


class UnloadLoraAdapterRequest(BaseModel):
    lora_name: str
    lora_int_id: int | None = None  # accepted for vLLM compatibility; names identify adapters here


# ---- responses ------------------------------------------------------------------------------


def now() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens whose KV came from the prefix cache


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails  # always set (vLLM and SGLang need a flag for it)

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> Usage:
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)  # None for echoed prompt tokens
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's entry of `prompt_logprobs`: one token's logprob, rank (1 = most likely) and text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per prompt token, keyed by token id (the prompt's token first, then the top k); the
# first token's entry is None: nothing predicts it.
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    prompt_logprobs: PromptLogprobs | None = None  # vLLM extension, when `prompt_logprobs` is asked for


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] = Field(default_factory=list)


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = None  # vLLM extension, when `prompt_logprobs` is asked for


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "loraplex"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class LoadedAdapter(BaseModel):
    """Our answer to load/unload (vLLM answers with a plain-text sentence and the same status)."""

    lora_name: str
    digest: str
    rank: int
    lora_path: str | None = None
    draining_requests: int | None = None  # unload: accepted requests that still run on the adapter


# ---- errors ---------------------------------------------------------------------------------


class ErrorDetail(BaseModel):
    message: str
    type: str  # e.g. invalid_request_error, not_found_error, service_unavailable
    param: str | None = None  # the request field at fault, when there is one
    code: str | int | None = None  # e.g. context_length_exceeded, model_not_found; else the HTTP status


class ErrorResponse(BaseModel):
    """OpenAI's error shape, which every error of the API has (documented in the OpenAPI schema)."""

    error: ErrorDetail
