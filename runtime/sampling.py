"""Per-request sampling: temperature, top-k, top-p, seed; greedy at temperature 0.

Contract: ``sample`` reads one row of logits and never changes it; the only state it touches is the
request's own ``torch.Generator``, so a seeded request draws the same tokens whatever else runs in
the batch beside it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int  # tokens to generate at most (the prompt not included)
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # nucleus mass kept, in (0, 1]
    top_k: int = 0  # keep the k most likely tokens; 0 = all
    seed: int | None = None  # seeds the request's generator; None = a fresh random seed
    stop: tuple[str, ...] = ()  # stop strings: the text ends before the first match
    stop_token_ids: tuple[int, ...] = field(default=())  # extra end-of-sequence ids
    ignore_eos: bool = False  # keep going past EOS (benchmarks)

    def check(self) -> None:
        """Raise ValueError naming the field when a value is out of range."""
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens = {self.max_tokens}: expected at least 1")
        if not self.temperature >= 0:
            raise ValueError(f"temperature = {self.temperature}: expected a number >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p = {self.top_p}: expected a number in (0, 1]")
        if self.top_k < 0:
            raise ValueError(f"top_k = {self.top_k}: expected 0 (off) or a positive number")
        if any(not s for s in self.stop):
            raise ValueError("stop: expected non-empty strings")


def make_generator(seed: int | None) -> torch.Generator:
    g = torch.Generator(device="cpu")
    if seed is None:
        g.seed()
    else:
        g.manual_seed(int(seed) & 0xFFFF_FFFF_FFFF_FFFF)
    return g


def sample(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator) -> int:
    """One token from ``logits`` ([V], any float dtype, any device)."""
    logits = logits.detach().float().cpu()
    if params.temperature == 0 or params.top_k == 1:
        return int(torch.argmax(logits))
    x = logits / params.temperature
    if 0 < params.top_k < x.numel():
        kth = torch.topk(x, params.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, idx = torch.sort(x, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        # drop a token when the mass before it already reaches top_p (the top token always stays)
        drop = (torch.cumsum(probs, dim=-1) - probs) >= params.top_p
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        x = torch.full_like(x, float("-inf")).scatter(0, idx, sorted_x)
    probs = torch.softmax(x, dim=-1)
    return int(torch.multinomial(probs, 1, generator=gen))
