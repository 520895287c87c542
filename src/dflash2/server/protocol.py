"""Request bodies (OpenAI and SGLang shapes), validated by pydantic.

Nothing is silently ignored: an unknown field is refused by name (``extra="forbid"``), and a
field we know but do not implement is accepted only at its no-op value (``UNSUPPORTED``), so a
client asking for logprobs, penalties or structured output gets a 400 that says so instead of an
answer that quietly lacks them. Numbers must be finite; strings must be valid Unicode (a lone
surrogate cannot be tokenized). Bounds that depend on the model (token ids, context length) are
checked where the model is known (``LLMEngine.add_request``, ``make_request``)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..sampling import MAX_LOGPROBS, MAX_TEMPERATURE, MAX_TOP_K, SEED_RANGE

MAX_STOP_STRINGS = 64
MAX_N = 64
MAX_TOKENS = 2**31 - 1  # an int64 larger than any context; keeps arithmetic on it in range


def _check_text(value: Any, where: str) -> None:
    """Refuse strings that are not valid UTF-8 (lone surrogates from a JSON ``\\ud800`` escape)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"{where}: text holds an unpaired surrogate, not valid Unicode") from None
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_text(k, where)
            _check_text(v, f"{where}.{k}")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_text(v, f"{where}[{i}]")


# field -> the values it may take while we do not implement it (its default, or an explicit no-op)
UNSUPPORTED: dict[str, tuple] = {
    "logit_bias": (None, {}),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0),
    "response_format": (None, {"type": "text"}),
    "suffix": (None, ""),
    "json_schema": (None,),
    "regex": (None,),
    "ebnf": (None,),
    "skip_special_tokens": (None, True),
    "no_stop_trim": (None, False),
    # SGLang's request fields its own clients send at their no-op value (bench_serving: every request)
    "lora_path": (None, ""),
    "return_routed_experts": (None, False),
    "token_ids_logprob": (None,),
    "image_data": (None,),
}


class _Base(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for key, allowed in UNSUPPORTED.items():
                if key in data and key in cls.model_fields and data[key] not in allowed:
                    raise ValueError(f"parameter {key!r} = {data[key]!r} is not supported by this server")
            _check_text(data, "body")
        return data


class _Sampling(_Base):
    """What every endpoint's sampling takes (OpenAI names; SGLang's top_k / min_p / stop_token_ids)."""

    temperature: float = Field(1.0, ge=0.0, le=MAX_TEMPERATURE)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1, le=MAX_TOP_K)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_STOP_STRINGS)
    ignore_eos: bool = False
    n: int = Field(1, ge=1, le=MAX_N)  # parallel samples of each prompt (not streamed)
    # known, not implemented: refused unless at their no-op value (UNSUPPORTED)
    logit_bias: dict[str, float] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    skip_special_tokens: bool | None = None
    no_stop_trim: bool | None = None

    @model_validator(mode="after")
    def _stops(self):
        stops = self.stop_strings()
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"stop: at most {MAX_STOP_STRINGS} stop strings")
        if any(not s for s in stops):
            raise ValueError("stop: a stop string must not be empty")
        return self

    def stop_strings(self) -> tuple[str, ...]:
        return tuple(self.stop) if isinstance(self.stop, list) else ((self.stop,) if self.stop else ())

    @property
    def effective_seed(self) -> int | None:
        return self.seed


class SamplingFields(_Sampling):
    user: str | None = None  # accepted; a no-op here
    logprobs: bool | int | None = None
    min_tokens: int | None = Field(None, ge=0, le=MAX_TOKENS)
    best_of: int | None = None
    lora_path: str | None = None  # refused unless empty: no LoRA adapters here (UNSUPPORTED)


class StreamOptions(_Base):
    include_usage: bool | None = None  # OpenAI: a last chunk with no choices and the usage
    continuous_usage_stats: bool | None = None  # vLLM: the usage so far on every chunk


class _Streamed(_Base):
    @model_validator(mode="after")
    def _options_need_stream(self):
        if getattr(self, "stream_options", None) is not None and not getattr(self, "stream", False):
            raise ValueError("stream_options is only allowed when stream is true")
        return self


class ChatCompletionRequest(SamplingFields, _Streamed):
    model: str | None = None
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    stream: bool = False
    stream_options: StreamOptions | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    response_format: dict[str, Any] | None = None
    continue_final_message: bool = False  # vLLM's: the last (assistant) message is continued, not closed
    add_generation_prompt: bool = True  # vLLM's: open an assistant turn after the messages

    def logprobs_k(self) -> int | None:
        """OpenAI's chat rule: ``logprobs: true`` returns each token's log-probability, ``top_logprobs``
        (which needs it) the k most likely alternatives."""
        return (self.top_logprobs or 0) if self.logprobs else None

    @model_validator(mode="after")
    def _tool_choice(self):
        if self.logprobs not in (None, True, False):
            raise ValueError("parameter 'logprobs' of a chat completion is a boolean; top_logprobs gives how many")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("parameter 'top_logprobs' needs 'logprobs': true")
        if self.best_of not in (None, 1):
            raise ValueError("parameter 'best_of' is not supported by chat completions (a /v1/completions parameter)")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError(
                "parameter 'continue_final_message' needs 'add_generation_prompt': false (vLLM's rule: one "
                "continues the last message, the other opens a new one)"
            )
        if self.continue_final_message and (not self.messages or self.messages[-1].get("role") != "assistant"):
            raise ValueError("parameter 'continue_final_message': the last message must be the assistant's")
        if self.tool_choice not in (None, "auto", "none"):
            raise ValueError(
                f"parameter 'tool_choice' = {self.tool_choice!r} is not supported by this server "
                f"(only 'auto' and 'none')"
            )
        return self


class CompletionRequest(SamplingFields, _Streamed):
    model: str | None = None
    prompt: str | list[int] | list[str] | list[list[int]]  # one prompt, or a batch of them
    max_tokens: int | None = Field(16, ge=1, le=MAX_TOKENS)
    stream: bool = False
    stream_options: StreamOptions | None = None
    echo: bool | None = None
    suffix: str | None = None

    @model_validator(mode="after")
    def _logprobs(self):
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            if self.logprobs is not False:
                raise ValueError(f"parameter 'logprobs' of a completion is an integer in [0, {MAX_LOGPROBS}]")
        return self

    def logprobs_k(self) -> int | None:
        return None if self.logprobs is None or self.logprobs is False else int(self.logprobs)

    def prompt_logprobs_k(self) -> int | None:
        """``echo`` with ``logprobs``: the prompt's tokens come back with theirs (the first: null)."""
        return self.logprobs_k() if self.echo else None

    @model_validator(mode="after")
    def _best_of(self):
        if self.best_of is not None:
            if not 1 <= self.best_of <= MAX_N:
                raise ValueError(f"parameter 'best_of' must be in [1, {MAX_N}]")
            if self.best_of < self.n:
                raise ValueError(f"parameter 'best_of' ({self.best_of}) must be >= n ({self.n})")
            if self.stream and self.best_of > self.n:
                raise ValueError("parameter 'best_of' > n cannot be streamed (OpenAI's rule)")
        return self


class GenerateSampling(_Sampling):
    max_new_tokens: int = Field(128, ge=1, le=MAX_TOKENS)
    sampling_seed: int | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1])  # SGLang's name for seed
    min_new_tokens: int | None = Field(None, ge=0, le=MAX_TOKENS)  # SGLang's name for min_tokens
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None

    @property
    def max_tokens(self) -> int:
        return self.max_new_tokens

    @property
    def effective_seed(self) -> int | None:
        return self.sampling_seed if self.sampling_seed is not None else self.seed


class GenerateRequest(_Base):
    text: str | list[str] | None = None  # one prompt, or a batch
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: GenerateSampling = Field(default_factory=lambda: GenerateSampling())
    stream: bool = False
    rid: str | None = None
    return_logprob: bool | None = None
    logprob_start_len: int | None = None
    top_logprobs_num: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    return_text_in_logprobs: bool | None = None
    # known, not implemented: refused unless at their no-op value (UNSUPPORTED)
    lora_path: str | list[str] | None = None
    return_routed_experts: bool | None = None
    token_ids_logprob: list[int] | None = None
    image_data: Any = None

    def logprobs_k(self) -> int | None:
        return (self.top_logprobs_num or 0) if self.return_logprob else None

    def prompt_logprobs_k(self) -> int | None:
        """SGLang's ``logprob_start_len`` >= 0: the prompt's logprobs from that position on."""
        start = self.logprob_start_len
        return self.logprobs_k() if start is not None and start >= 0 else None

    @model_validator(mode="after")
    def _logprob_start(self):
        if self.logprob_start_len is not None and self.logprob_start_len < -1:
            raise ValueError("parameter 'logprob_start_len' must be -1 (no prompt logprobs) or >= 0")
        return self
