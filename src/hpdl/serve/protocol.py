"""OpenAI-compatible request schemas (pydantic) and their translation to ``SamplingParams``.

Fields follow the OpenAI API; ``top_k``, ``ignore_eos`` and ``stop_token_ids`` are vLLM's extensions.
Unknown fields are ignored, as OpenAI-compatible servers do; unsupported values (``n > 1``) are rejected.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from hpdl.serve.sampling import SamplingParams


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = -1
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    stream: bool = False
    stream_options: dict | None = None
    n: Literal[1] = 1
    user: str | None = None

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        """Raises ValueError (-> HTTP 400) for values SamplingParams rejects."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(max_tokens=self.max_tokens or default_max_tokens, temperature=self.temperature,
                              top_k=self.top_k, top_p=self.top_p, seed=self.seed, stop=stop,
                              stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] = Field(description="text, token ids, or a list of exactly one text")

    def prompt_input(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, list) and p and all(isinstance(x, str) for x in p):
            if len(p) != 1:
                raise ValueError(f"prompt: batches of text prompts are not supported, got {len(p)}")
            return p[0]
        if isinstance(p, list) and not p:
            raise ValueError("prompt: must not be empty")
        return p


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        if self.max_tokens is None and self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return super().sampling_params(default_max_tokens)


def error_body(message: str, code: int, param: str | None = None, type_: str = "invalid_request_error") -> dict:
    """OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
