"""Per-request sampling: temperature, top-k, top-p, seed; greedy at temperature 0.

Contract: ``sample`` reads one row of logits and never changes it; the only state it touches is the
request's own ``torch.Generator``, so a seeded request draws the same tokens whatever else runs in
the batch beside it.
"""

from __future__ import annotations

from collections.abc import Sequence
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
    """One token from ``logits`` ([V], any float dtype, any device): ``sample_batch`` of one row."""
    return sample_batch(logits[None], [params], [gen])[0]


def sample_batch(logits: torch.Tensor, params: Sequence[SamplingParams], gens: Sequence[torch.Generator]) -> list[int]:
    """One token per row of ``logits`` [B, V] (any float dtype, any device), row b under
    ``params[b]`` with generator ``gens[b]``, computed where the logits are with one copy of the B
    tokens to the host (a vocabulary of 262,144 sampled on the host took 8 ms a row, 35 ms with
    top_p). A sampled row draws one uniform number from its own generator and takes the token where
    it falls in the cumulative distribution of what temperature, top_k and top_p leave; so a row's
    token depends on its logits, its parameters and its generator only, never on the other rows."""
    B = logits.shape[0]
    device = logits.device
    greedy = [b for b, p in enumerate(params) if p.temperature == 0 or p.top_k == 1]
    drawn = [b for b, p in enumerate(params) if not (p.temperature == 0 or p.top_k == 1)]
    if not drawn:  # the whole batch greedy: no copy of its rows
        return logits.argmax(-1).tolist()
    if not greedy:
        return _draw(logits.float(), params, gens).tolist()
    tokens = torch.empty(B, dtype=torch.long, device=device)
    rows = torch.tensor(greedy, device=device)
    tokens[rows] = logits[rows].argmax(-1)
    rows = torch.tensor(drawn, device=device)
    tokens[rows] = _draw(logits[rows].float(), [params[b] for b in drawn], [gens[b] for b in drawn])
    return tokens.tolist()


def _draw(x: torch.Tensor, params: Sequence[SamplingParams], gens: Sequence[torch.Generator]) -> torch.Tensor:
    """Tokens [R] drawn from the rows of logits ``x`` [R, V] (float32)."""
    V = x.shape[1]
    device, inf = x.device, float("inf")
    x = x / torch.tensor([p.temperature for p in params], device=device)[:, None]
    ks = torch.tensor([p.top_k if 0 < p.top_k < V else 0 for p in params], device=device)
    if bool((ks > 0).any()):  # keep each row's k largest (and any equal to its k-th)
        top = torch.topk(x, int(ks.max()), dim=-1).values  # [R, max k]
        kth = top.gather(1, (ks.clamp(min=1) - 1)[:, None])
        x = x.masked_fill((x < kth) & (ks[:, None] > 0), -inf)
    if any(p.top_p < 1.0 for p in params):
        # drop a token when the mass before it already reaches top_p (the top token always stays)
        mass = torch.tensor([p.top_p if p.top_p < 1.0 else inf for p in params], device=device)[:, None]
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        drop = (torch.cumsum(probs, dim=-1) - probs) >= mass
        x = torch.full_like(x, -inf).scatter(1, order, sorted_x.masked_fill(drop, -inf))
    cdf = torch.softmax(x, dim=-1).double().cumsum(-1)  # [R, V]; a dropped token adds nothing
    u = torch.tensor([float(torch.rand((), generator=g, dtype=torch.float64)) for g in gens], dtype=torch.float64,
                     device=device)
    # the first token whose cumulative mass passes u of the row's total: never one of mass 0
    return torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0].clamp(max=V - 1)
