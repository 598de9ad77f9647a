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
    token depends on its logits, its parameters and its generator only, never on the other rows.
    The rows' parameters reach the device in one asynchronous copy and nothing is read back before
    the tokens: a step waits for the device once."""
    greedy, drawn = [], []
    for b, p in enumerate(params):
        (greedy if p.temperature == 0 or p.top_k == 1 else drawn).append(b)
    if not drawn:  # the whole batch greedy: no copy of its rows
        return logits.argmax(-1).tolist()
    rows = _Rows.to_device([params[b] for b in drawn], [gens[b] for b in drawn], drawn, greedy, logits.shape[1],
                           logits.device)
    if not greedy:
        return _draw(logits.float(), rows).tolist()
    tokens = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
    tokens[rows.greedy] = logits[rows.greedy].argmax(-1)
    tokens[rows.drawn] = _draw(logits[rows.drawn].float(), rows)
    return tokens.tolist()


@dataclass(frozen=True, slots=True)
class _Rows:
    """The sampled rows' parameters on the logits' device, and what the host knows of them."""

    temperature: torch.Tensor  # [R] float32
    k: torch.Tensor  # [R] int64; 0 = no top-k
    mass: torch.Tensor  # [R] float32: top_p, inf = no top-p
    u: torch.Tensor  # [R] float64: each row's uniform draw
    drawn: torch.Tensor  # [R] int64: the sampled rows of the batch
    greedy: torch.Tensor  # [B - R] int64: the greedy rows
    kmax: int  # the largest k, 0 = no row keeps a top-k
    top_p: bool  # some row keeps a top-p

    @staticmethod
    def to_device(params: Sequence[SamplingParams], gens: Sequence[torch.Generator], drawn: list[int],
                  greedy: list[int], vocab: int, device: torch.device) -> _Rows:
        """Packed in one float64 host tensor (pinned for CUDA), copied without waiting: float64 holds
        the ints exactly and rounds to the same float32 values as ``torch.tensor`` of the floats."""
        ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
        mass = [p.top_p if p.top_p < 1.0 else float("inf") for p in params]
        values = torch.tensor([p.temperature for p in params] + ks + mass + drawn + greedy, dtype=torch.float64)
        host = torch.cat([values, *(torch.rand(1, generator=g, dtype=torch.float64) for g in gens)])
        if device.type == "cuda":
            host = host.pin_memory()
        R = len(params)
        t, k, m, d, g, u = host.to(device, non_blocking=True).split([R, R, R, R, len(greedy), R])
        return _Rows(t.float(), k.long(), m.float(), u, d.long(), g.long(), max(ks), any(p.top_p < 1.0 for p in params))


def _draw(x: torch.Tensor, rows: _Rows) -> torch.Tensor:
    """Tokens [R] drawn from the rows of logits ``x`` [R, V] (float32)."""
    V = x.shape[1]
    inf = float("inf")
    x = x / rows.temperature[:, None]
    ks = rows.k
    if rows.kmax:  # keep each row's k largest (and any equal to its k-th)
        top = torch.topk(x, rows.kmax, dim=-1).values  # [R, max k]
        kth = top.gather(1, (ks.clamp(min=1) - 1)[:, None])
        x = x.masked_fill((x < kth) & (ks[:, None] > 0), -inf)
    if rows.top_p:
        # drop a token when the mass before it already reaches top_p (the top token always stays)
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        drop = (torch.cumsum(probs, dim=-1) - probs) >= rows.mass[:, None]
        x = torch.full_like(x, -inf).scatter(1, order, sorted_x.masked_fill(drop, -inf))
    cdf = torch.softmax(x, dim=-1).double().cumsum(-1)  # [R, V]; a dropped token adds nothing
    # the first token whose cumulative mass passes u of the row's total: never one of mass 0
    return torch.searchsorted(cdf, (rows.u * cdf[:, -1])[:, None], right=True)[:, 0].clamp(max=V - 1)
