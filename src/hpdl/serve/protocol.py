"""OpenAI-compatible request schemas (pydantic), their bounds, and their translation to ``SamplingParams``.

Fields follow the OpenAI API; ``top_k``, ``min_tokens``, ``repetition_penalty``, ``ignore_eos`` and
``stop_token_ids`` are vLLM's extensions. Nothing is silently ignored: an unknown field is a 400 naming it, and
an OpenAI field this server does not implement (``suffix``, ``tools``, ``response_format`` ...) is accepted only
at its "off" value. Every list and number a request carries is bounded (``LIMITS``).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationInfo,
                      field_validator)

from hpdl.serve.sampling import MAX_LOGPROBS, InvalidParamError, SamplingParams

INT64 = (-2**63, 2**63 - 1)

# Bounds of one request (docs/serve.md, "Limits"). OpenAI's own where it has one (4 stop strings, 300 logit_bias
# entries, penalties in [-2, 2], temperature in [0, 2]); generous but finite elsewhere.
LIMITS = {
    "stop": 16,  # strings
    "stop_len": 256,  # characters per stop string (streamed text is held back by the longest - 1)
    "stop_token_ids": 64,
    "logit_bias": 300,  # entries
    "n": 16,  # n and best_of
    "sequences": 64,  # prompts x max(n, best_of) in one request
    "prompts": 64,  # prompts in one completion request
    "prompt_tokens": 1 << 20,  # ids in one token-id prompt (the context length is checked by the engine)
    "messages": 4096,
    "max_tokens": 1 << 31,
}

# Status -> OpenAI error ``type``.
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 408: "timeout_error",
               413: "invalid_request_error", 422: "invalid_request_error", 429: "rate_limit_error",
               500: "server_error", 503: "service_unavailable_error"}


def error_body(message: str, code: int, param: str | None = None) -> dict:
    """OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}``; ``type`` follows the status."""
    kind = ERROR_TYPES.get(code, "server_error" if code >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _unsupported(info: ValidationInfo, value: Any, allowed: tuple) -> Any:
    if value not in allowed:
        ok = " or ".join(["null", *(repr(a) for a in allowed if a is not None)])
        raise ValueError(f"{info.field_name} is not supported by this server (accepted: {ok}); see docs/serve.md")
    return value


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool = False


class _Sampling(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    model: StrictStr | None = None
    max_tokens: StrictInt | None = Field(default=None, ge=1, le=LIMITS["max_tokens"])
    temperature: StrictFloat | None = Field(default=1.0, ge=0.0, le=2.0)
    top_p: StrictFloat | None = Field(default=1.0, gt=0.0, le=1.0)
    top_k: StrictInt | None = Field(default=-1, ge=-1, le=LIMITS["max_tokens"])
    seed: StrictInt | None = Field(default=None, ge=INT64[0], le=INT64[1])
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[StrictInt] | None = Field(default=None, max_length=LIMITS["stop_token_ids"])
    ignore_eos: StrictBool = False
    min_tokens: StrictInt = Field(default=0, ge=0, le=LIMITS["max_tokens"])
    presence_penalty: StrictFloat | None = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: StrictFloat | None = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: StrictFloat | None = Field(default=1.0, gt=0.0, le=100.0)
    logit_bias: dict[StrictStr, StrictFloat] | None = None
    n: StrictInt | None = Field(default=1, ge=1, le=LIMITS["n"])
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > LIMITS["stop"]:
            raise ValueError(f"at most {LIMITS['stop']} stop strings, got {len(stops)}")
        if any(not 1 <= len(s) <= LIMITS["stop_len"] for s in stops):
            raise ValueError(f"each stop string must have 1..{LIMITS['stop_len']} characters")
        return stops

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids(cls, v):
        if any(t < 0 for t in v or []):
            raise ValueError("token ids must be >= 0")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v):
        if v is None:
            return {}
        if len(v) > LIMITS["logit_bias"]:
            raise ValueError(f"at most {LIMITS['logit_bias']} entries, got {len(v)}")
        out = {}
        for key, b in v.items():
            if not key.isdigit():
                raise ValueError(f"keys must be token ids (non-negative integers as strings), got {key!r}")
            if not -100 <= b <= 100:
                raise ValueError(f"values must be in [-100, 100], got {b} for token {key}")
            out[int(key)] = float(b)
        return out

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def num_choices(self) -> int:
        return self.n or 1

    def _params(self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None = None
                ) -> SamplingParams:
        """SamplingParams of one choice; raises InvalidParamError (-> HTTP 400) naming the field."""
        return SamplingParams(
            max_tokens=max_tokens, temperature=1.0 if self.temperature is None else self.temperature,
            top_k=self.top_k if self.top_k is not None else -1, top_p=1.0 if self.top_p is None else self.top_p,
            seed=self.seed, stop=list(self.stop or []), stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos, min_tokens=self.min_tokens,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            frequency_penalty=self.frequency_penalty or 0.0, presence_penalty=self.presence_penalty or 0.0,
            logit_bias=dict(self.logit_bias or {}), logprobs=logprobs, prompt_logprobs=prompt_logprobs)


class CompletionRequest(_Sampling):
    """POST /v1/completions. ``prompt``: text, token ids, or a list of either (a batch); ``logprobs`` 0..20;
    ``echo`` returns the prompt (and with ``logprobs`` its tokens' logprobs) before the completion;
    ``best_of`` candidates per prompt of which the ``n`` with the highest mean token logprob are returned."""

    prompt: Any = Field(description="text, token ids, or a list of texts / token-id lists (a batch)")
    logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: StrictBool | None = False
    best_of: StrictInt | None = Field(default=None, ge=1, le=LIMITS["n"])
    suffix: Any = None

    @field_validator("suffix", mode="before")
    @classmethod
    def _off(cls, v, info: ValidationInfo):
        return _unsupported(info, v, (None, ""))

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, p):
        """-> a list of prompts, each a text or a list of token ids (``True`` is not a token id)."""
        def ids(x):
            return isinstance(x, list) and len(x) > 0 and all(type(t) is int for t in x)

        if isinstance(p, str):
            prompts = [p]
        elif ids(p):
            prompts = [p]
        elif isinstance(p, list) and p and (all(isinstance(x, str) for x in p) or all(ids(x) for x in p)):
            prompts = list(p)
        else:
            raise ValueError("prompt must be a string, a non-empty list of token ids (integers), or a non-empty "
                             "list of strings or of token-id lists")
        if len(prompts) > LIMITS["prompts"]:
            raise ValueError(f"at most {LIMITS['prompts']} prompts per request, got {len(prompts)}")
        if any(isinstance(x, list) and len(x) > LIMITS["prompt_tokens"] for x in prompts):
            raise ValueError(f"a token-id prompt may hold at most {LIMITS['prompt_tokens']} ids")
        return prompts

    @property
    def num_candidates(self) -> int:
        return max(self.num_choices, self.best_of or 1)

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        """Raises InvalidParamError (-> HTTP 400) naming the field."""
        n, best = self.num_choices, self.best_of
        if best is not None and best < n:
            raise InvalidParamError("best_of", f"best_of ({best}) must be >= n ({n})")
        if best is not None and best > n and self.stream:
            raise InvalidParamError("best_of", "best_of > n cannot be streamed (the best are known only at the end)")
        if len(self.prompt) * max(n, best or 1) > LIMITS["sequences"]:
            raise InvalidParamError("n", f"prompts x max(n, best_of) must be <= {LIMITS['sequences']}, got "
                                         f"{len(self.prompt)} x {max(n, best or 1)}")
        max_tokens = self.max_tokens if self.max_tokens is not None else default_max_tokens
        lp = self.logprobs
        if self.num_candidates > self.num_choices and lp is None:
            lp = 0  # ranking best_of candidates needs their logprobs (not returned unless asked)
        return self._params(max_tokens, lp, self.logprobs if self.echo and self.logprobs is not None else None)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant", "developer"]
    content: StrictStr | list[TextPart]
    name: StrictStr | None = None

    def as_dict(self) -> dict:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": self.role, "content": text} | ({"name": self.name} if self.name else {})


_CHAT_OFF = {"response_format": (None, {"type": "text"}), "tools": (None, []), "tool_choice": (None, "none"),
             "functions": (None, []), "function_call": (None, "none"), "audio": (None,),
             "modalities": (None, ["text"]), "prediction": (None,), "reasoning_effort": (None,),
             "web_search_options": (None,), "service_tier": (None, "auto", "default"), "store": (None, False)}


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions. ``logprobs`` (bool) with ``top_logprobs`` 0..20; without ``max_tokens`` /
    ``max_completion_tokens`` the output may fill the context (OpenAI)."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=LIMITS["messages"])
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1, le=LIMITS["max_tokens"])
    logprobs: StrictBool | None = False
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    # OpenAI fields not implemented here: accepted only at their "off" value (never silently ignored)
    response_format: Any = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    parallel_tool_calls: StrictBool | None = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    web_search_options: Any = None
    service_tier: Any = None
    store: Any = None
    metadata: dict[StrictStr, StrictStr] | None = Field(default=None, max_length=16)

    @field_validator(*_CHAT_OFF, mode="before")
    @classmethod
    def _off(cls, v, info: ValidationInfo):
        return _unsupported(info, v, _CHAT_OFF[info.field_name])

    def sampling_params(self, default_max_tokens: int | None = None) -> SamplingParams:
        """``max_tokens`` (or ``max_completion_tokens``); None fills the context. Raises InvalidParamError."""
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidParamError("top_logprobs", "top_logprobs needs logprobs: true")
        max_tokens = self.max_tokens if self.max_tokens is not None else self.max_completion_tokens
        lp = (self.top_logprobs or 0) if self.logprobs else None
        return self._params(max_tokens if max_tokens is not None else default_max_tokens, lp)
