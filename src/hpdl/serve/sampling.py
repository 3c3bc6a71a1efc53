"""Sampling parameters and the per-step sampling pipeline: logits -> processors -> sampler -> logprobs.

1. **processors** change a request's logits row (``apply_penalties``, ``apply_logit_bias``, ``apply_min_tokens``);
2. the **sampler** picks one token per row (greedy argmax, or temperature, top-k, top-p with the request's own
   ``torch.Generator``);
3. **logprobs** are the log-softmax of the model's own logits (vLLM's default ``raw_logprobs``): processors and
   sampling settings change which token is chosen, never the reported numbers.

Every per-row stage runs under its own ``try``: an exception for one request is returned as that row's error
(``SampleOutput.errors``) and the other rows keep their tokens, so one request can never stop the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

SEED_RANGE = (-2**63, 2**64 - 1)  # what torch.Generator.manual_seed accepts
MIN_TEMPERATURE = 1e-5  # below it a request is greedy (vLLM's _SAMPLING_EPS): 1/T would overflow the logits
MAX_LOGPROBS = 20  # alternatives per token (OpenAI chat's top_logprobs bound)
LOGPROB_FLOOR = -9999.0  # -inf is not JSON; reported log-probabilities are clipped here (as vLLM does)


class InvalidParamError(ValueError):
    """A request parameter is out of range; ``param`` names it (the OpenAI error body's ``param``)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param

    def __reduce__(self):   # pickled across processes: Exception's default passes only the message back
        return type(self), (self.param, str(self)), self.__dict__


def _int(name: str, v, lo: int, hi: int | None = None) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise InvalidParamError(name, f"{name} must be an integer {rng}, got {v!r}")


def _num(name: str, v, lo: float, hi: float, lo_open: bool = False) -> None:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and (lo < v if lo_open else lo <= v) and v <= hi
    if not ok:
        raise InvalidParamError(name, f"{name} must be a number in {'(' if lo_open else '['}{lo}, {hi}], got {v!r}")


@dataclass
class SamplingParams:
    """What one request asks for; checked at construction (``InvalidParamError`` names the field and range).

    Generation: ``max_tokens`` output tokens at most (None: the rest of the context, ``max_seq_len`` minus the
    prompt); ``min_tokens`` before EOS, ``stop_token_ids`` or stop strings may end it (vLLM). ``stop`` strings
    end the output before the string; ``stop_token_ids`` and EOS end it after the token without its text.

    Sampling: ``temperature < 1e-5`` is greedy (argmax). ``top_k <= 0`` and ``top_p == 1`` disable those filters.
    ``seed`` makes a sampled request reproducible whatever else is in the batch (one torch.Generator each).

    Processors (applied in this order, before temperature): ``repetition_penalty`` (CTRL, Keskar et al. 2019, as
    HF and vLLM: a logit of a token seen in the prompt or output is divided by it when positive, multiplied
    when negative); ``frequency_penalty`` / ``presence_penalty`` (OpenAI: ``logit -= frequency * count +
    presence * (count > 0)`` over output tokens); ``logit_bias`` (token id -> value added); ``min_tokens``
    (EOS and ``stop_token_ids`` masked to -inf until that many tokens exist).

    Logprobs: ``logprobs = k`` reports each output token's log-probability and the k most likely tokens;
    ``prompt_logprobs = k`` the same for every prompt token after the first. ``detokenize=False`` skips text
    (benchmarks); stop strings then need text.
    """

    max_tokens: int | None = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.max_tokens is not None:
            _int("max_tokens", self.max_tokens, 1)
        _int("min_tokens", self.min_tokens, 0, self.max_tokens)
        _num("temperature", self.temperature, 0.0, float("inf"))
        if self.temperature == float("inf"):
            raise InvalidParamError("temperature", "temperature must be finite")
        _int("top_k", self.top_k, -1)
        _num("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        if self.seed is not None:
            _int("seed", self.seed, *SEED_RANGE)
        if any((not isinstance(s, str)) or s == "" for s in self.stop):
            raise InvalidParamError("stop", f"stop must be non-empty strings, got {self.stop!r}")
        for t in self.stop_token_ids:
            _int("stop_token_ids", t, 0)
        _num("repetition_penalty", self.repetition_penalty, 0.0, 100.0, lo_open=True)
        _num("frequency_penalty", self.frequency_penalty, -100.0, 100.0)
        _num("presence_penalty", self.presence_penalty, -100.0, 100.0)
        for t, b in self.logit_bias.items():
            _int("logit_bias", t, 0)
            _num("logit_bias", b, -100.0, 100.0)
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _int(name, getattr(self, name), 0, MAX_LOGPROBS)
        if self.stop and not self.detokenize:
            raise InvalidParamError("stop", "stop strings need detokenize=True")

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids and counts against the model's vocabulary (the engine calls this before queueing)."""
        for name, ids in (("logit_bias", self.logit_bias), ("stop_token_ids", self.stop_token_ids)):
            bad = [t for t in ids if t >= vocab_size]
            if bad:
                raise InvalidParamError(name, f"{name}: token ids must be in [0, {vocab_size}), got {bad[:5]}")
        if self.top_k > vocab_size:
            raise InvalidParamError("top_k", f"top_k must be -1 or 0 (off) or 1..{vocab_size}, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE

    @property
    def has_processors(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0
                or bool(self.logit_bias) or self.min_tokens > 0)

    @property
    def uses_counts(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0


class SampledRequest(Protocol):
    """What the sampler reads of a request (the scheduler's :class:`hpdl.serve.scheduler.Request` has it): its id
    (per-request generator seeds), its :class:`SamplingParams`, and the prompt and output token ids so far
    (repetition, frequency and presence penalties)."""

    request_id: str
    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int]


@dataclass(slots=True)
class TokenLogprob:
    """One token's log-probability and the ``top`` alternatives ``[(token_id, logprob), ...]``, most likely first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


# --- 1. processors: pure functions of one logits row (float32, modified in place and returned) -----------
def apply_penalties(x: torch.Tensor, counts: torch.Tensor, prompt_seen: torch.Tensor | None,
                    p: SamplingParams) -> torch.Tensor:
    """Repetition (over prompt and output tokens), then frequency and presence penalties (output tokens).

    ``x [vocab]`` float32 logits; ``counts [vocab]`` float32 occurrences of each token in the output so far;
    ``prompt_seen [vocab]`` bool, tokens of the prompt (needed for the repetition penalty only).
    """
    if p.repetition_penalty != 1.0:
        seen = counts > 0 if prompt_seen is None else (counts > 0) | prompt_seen
        x = torch.where(seen, torch.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty), x)
    if p.frequency_penalty != 0.0:
        x = x - p.frequency_penalty * counts
    if p.presence_penalty != 0.0:
        x = x - p.presence_penalty * (counts > 0).to(x.dtype)
    return x


def apply_logit_bias(x: torch.Tensor, ids: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``x[ids] += values`` (OpenAI ``logit_bias``)."""
    return x.index_add_(0, ids, values)


def apply_min_tokens(x: torch.Tensor, num_output: int, p: SamplingParams, eos_token_id: int | None) -> torch.Tensor:
    """EOS and ``stop_token_ids`` get -inf while fewer than ``min_tokens`` tokens were generated."""
    if num_output < p.min_tokens:
        ids = list(p.stop_token_ids) + ([eos_token_id] if eos_token_id is not None else [])
        if ids:
            x[torch.tensor(ids, device=x.device)] = float("-inf")
    return x


# --- 3. logprobs -----------------------------------------------------------------------------------------
def token_logprobs(logits: torch.Tensor, tokens: list[int], k: int) -> list[TokenLogprob]:
    """Log-probability of ``tokens[i]`` under row i of ``logits [m, vocab]`` and each row's top ``k``."""
    lp = torch.log_softmax(logits.float(), dim=-1).clamp_min_(LOGPROB_FLOOR)
    chosen = lp.gather(1, torch.tensor(tokens, device=lp.device)[:, None])[:, 0].tolist()
    if k > 0:
        top = lp.topk(k, dim=-1)
        vals, idx = top.values.tolist(), top.indices.tolist()
        return [TokenLogprob(t, c, list(zip(i, v))) for t, c, i, v in zip(tokens, chosen, idx, vals)]
    return [TokenLogprob(t, c, []) for t, c in zip(tokens, chosen)]


def prompt_logprobs(logits: torch.Tensor, prompt_ids: list[int], k: int) -> list[TokenLogprob | None]:
    """Per prompt token: its log-probability given the tokens before it (None for the first).

    ``logits [len(prompt_ids), vocab]``: row t is the model's prediction after prompt token t.
    """
    if len(prompt_ids) < 2:
        return [None] * len(prompt_ids)
    return [None, *token_logprobs(logits[: len(prompt_ids) - 1], prompt_ids[1:], k)]


# --- 2. the sampler ---------------------------------------------------------------------------------------
@dataclass
class _RowState:
    generator: torch.Generator | None = None
    counts: torch.Tensor | None = None  # [vocab] output-token counts (penalties)
    prompt_seen: torch.Tensor | None = None  # [vocab] prompt tokens (repetition penalty)
    counted: int = 0  # output tokens already in ``counts``
    bias: tuple[torch.Tensor, torch.Tensor] | None = None


@dataclass
class SampleOutput:
    """Per row: the chosen token (-1 where the row has no request or failed), its ``TokenLogprob`` when the
    request asked for logprobs, and ``errors[row]`` for rows whose request raised."""

    tokens: list[int]
    logprobs: list[TokenLogprob | None]
    errors: dict[int, BaseException]


class Sampler:
    """Turns logits ``[n, vocab]`` into one token per row; keeps per-request state (generator, counts).

    Args:
        eos_token_id: masked by ``min_tokens``.
    """

    def __init__(self, eos_token_id: int | None = None):
        self.eos_token_id = eos_token_id
        self._state: dict[str, _RowState] = {}

    def release(self, request_id: str) -> None:
        self._state.pop(request_id, None)

    def sample(self, logits: torch.Tensor, rows: list[SampledRequest | None]) -> SampleOutput:
        """One token per row; ``rows[i]`` is the request of logits row i (None: a hole, skipped)."""
        n = len(rows)
        plain = all(r is None or (r.params.greedy and not r.params.has_processors and r.params.logprobs is None)
                    for r in rows)
        top = getattr(logits, "argmax_tokens", None)  # the fused decode step computed it already
        tokens = (top if top is not None else logits.argmax(dim=-1)).tolist()  # greedy rows; one device -> host copy
        if plain:  # fast path: every row greedy, nothing to process or report
            return SampleOutput([t if r is not None else -1 for t, r in zip(tokens, rows)], [None] * n, {})
        errors: dict[int, BaseException] = {}
        for i, req in enumerate(rows):
            if req is None:
                tokens[i] = -1
                continue
            p = req.params
            if p.greedy and not p.has_processors:
                continue
            try:
                tokens[i] = self._sample_row(logits[i], req)
            except Exception as exc:  # noqa: BLE001 - this request fails alone
                errors[i], tokens[i] = exc, -1
        return SampleOutput(tokens, self._logprobs(logits, rows, tokens, errors), errors)

    def _sample_row(self, row: torch.Tensor, req: SampledRequest) -> int:
        p = req.params
        x = row.to(torch.float32, copy=True)
        if p.has_processors:
            st = self._state.setdefault(req.request_id, _RowState())
            if p.uses_counts:
                x = apply_penalties(x, self._counts(st, req, x), st.prompt_seen, p)
            if p.logit_bias:
                if st.bias is None:
                    st.bias = (torch.tensor(list(p.logit_bias), device=x.device),
                               torch.tensor(list(p.logit_bias.values()), dtype=torch.float32, device=x.device))
                x = apply_logit_bias(x, *st.bias)
            x = apply_min_tokens(x, len(req.output_ids), p, self.eos_token_id)
        if p.greedy:
            return int(x.argmax())
        x = x / p.temperature
        if bool(x.max() == float("inf")):  # a logit overflowed float32 (a repetition_penalty near 0 divides by
            # it): those tokens are infinitely likelier than the rest and share the mass (softmax would give NaN)
            x = torch.where(x == float("inf"), 0.0, float("-inf"))
        if 0 < p.top_k < x.numel():
            kth = torch.topk(x, p.top_k).values[-1]
            x = x.masked_fill(x < kth, float("-inf"))
        if p.top_p < 1.0:  # nucleus: keep the smallest prefix of sorted tokens whose mass reaches top_p
            sx, idx = torch.sort(x, descending=True)
            probs = torch.softmax(sx, -1)
            drop = probs.cumsum(-1) - probs >= p.top_p
            drop[0] = False  # the likeliest token always stays (a top_p below float32's smallest value rounds to 0)
            x = x.scatter(0, idx, sx.masked_fill(drop, float("-inf")))
        st = self._state.setdefault(req.request_id, _RowState())
        if st.generator is None:
            st.generator = torch.Generator(device="cpu")
            st.generator.manual_seed(p.seed if p.seed is not None else int(torch.randint(0, 2**62, (1,)).item()))
        probs = torch.softmax(x, -1).cpu()
        return int(torch.multinomial(probs, 1, generator=st.generator).item())

    @staticmethod
    def _counts(st: _RowState, req: SampledRequest, x: torch.Tensor) -> torch.Tensor:
        """Output-token counts, updated with the tokens added since the last step (O(new tokens) per step)."""
        vocab, device = x.numel(), x.device
        if st.counts is None:
            st.counts = torch.zeros(vocab, dtype=torch.float32, device=device)
            if req.params.repetition_penalty != 1.0:
                st.prompt_seen = torch.zeros(vocab, dtype=torch.bool, device=device)
                st.prompt_seen[torch.tensor(req.prompt_ids, device=device)] = True
        new = req.output_ids[st.counted:]
        if new:
            st.counts.index_add_(0, torch.tensor(new, device=device), torch.ones(len(new), device=device))
            st.counted = len(req.output_ids)
        return st.counts

    def _logprobs(self, logits, rows, tokens, errors) -> list[TokenLogprob | None]:
        out: list[TokenLogprob | None] = [None] * len(rows)
        want = [i for i, r in enumerate(rows) if r is not None and r.params.logprobs is not None and i not in errors]
        if not want:
            return out
        k = max(rows[i].params.logprobs for i in want)
        try:
            got = token_logprobs(logits[want], [tokens[i] for i in want], k)
        except Exception:  # noqa: BLE001 - find the row(s) at fault: each alone
            got = []
            for i in want:
                try:
                    got.append(token_logprobs(logits[i:i + 1], [tokens[i]], rows[i].params.logprobs)[0])
                except Exception as exc:  # noqa: BLE001
                    errors[i], tokens[i] = exc, -1
                    got.append(None)
        for i, lp in zip(want, got):
            if lp is not None:
                kk = rows[i].params.logprobs
                out[i] = lp if len(lp.top) == kk else TokenLogprob(lp.token_id, lp.logprob, lp.top[:kk])
        return out
