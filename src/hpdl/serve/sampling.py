"""Sampling parameters and the token sampler (greedy, temperature, top-k, top-p, per-request seeds)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SamplingParams:
    """What one request asks for; validated at construction (ValueError names the field and expected value).

    ``temperature == 0`` is greedy (argmax). ``top_k <= 0`` and ``top_p == 1`` disable those filters.
    ``seed`` makes a sampled request reproducible whatever else is in the batch (one torch.Generator per
    request). ``stop`` strings end the output before the string; ``stop_token_ids`` and EOS end it after the
    token without adding its text. ``detokenize=False`` skips text (benchmarks); stop strings then need text.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    detokenize: bool = True

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int):
            raise ValueError(f"top_k must be an integer (<= 0 disables it), got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if any((not isinstance(s, str)) or s == "" for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
        if self.stop and not self.detokenize:
            raise ValueError("stop strings need detokenize=True")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class Sampler:
    """Turns logits ``[n, vocab]`` into one token per row; each sampled row uses its own generator."""

    def __init__(self):
        self._gens: dict[str, torch.Generator] = {}

    def release(self, request_id: str) -> None:
        self._gens.pop(request_id, None)

    def sample(self, logits: torch.Tensor, rows: list[tuple[str, SamplingParams]]) -> list[int]:
        """One token id per row (``rows[i]`` = (request id, params) of logits row i; None rows are skipped)."""
        if all(r is None or r[1].greedy for r in rows):  # fast path: one argmax, one device->host copy
            return logits.argmax(dim=-1).tolist()
        out = logits.argmax(dim=-1).tolist()
        for i, row in enumerate(rows):
            if row is None or row[1].greedy:
                continue
            rid, p = row
            x = logits[i].float() / p.temperature
            if p.top_k > 0 and p.top_k < x.numel():
                kth = torch.topk(x, p.top_k).values[-1]
                x = x.masked_fill(x < kth, float("-inf"))
            if p.top_p < 1.0:  # nucleus: keep the smallest prefix of sorted tokens whose mass reaches top_p
                sx, idx = torch.sort(x, descending=True)
                cum = torch.softmax(sx, -1).cumsum(-1)
                drop = cum - torch.softmax(sx, -1) >= p.top_p
                x = x.scatter(0, idx, sx.masked_fill(drop, float("-inf")))
            gen = self._gens.get(rid)
            if gen is None:
                gen = torch.Generator(device="cpu")
                gen.manual_seed(p.seed if p.seed is not None else int(torch.randint(0, 2**62, (1,)).item()))
                self._gens[rid] = gen
            probs = torch.softmax(x, -1).cpu()
            out[i] = int(torch.multinomial(probs, 1, generator=gen).item())
        return out
