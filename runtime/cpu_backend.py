"""The CPU serving backend: decode through the CPU executor (the very task schedule the GPU runs),
prefill in plain PyTorch writing the executor's KV cache.

The schedule is compiled once for ``batch = max_batch``; each batch row is a slot. A decode step
runs every row: rows not in the step get a dummy token at position 0, and their position-0 K/V is
saved before the step and put back after it, so an idle row never changes any slot's cache (the
attention of a row reads only its own row; MoE routing weights of other rows are zero for it).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mkc.ir.lower import lower
from mkc.ir.spec import ModelSpec
from mkc.runtime.prefill import Prefill
from mkc.schedule.executor import CpuExecutor
from mkc.schedule.scheduler import schedule


class CpuBackend:
    """``Backend`` (runtime/engine.py) over ``CpuExecutor``; also supports ``read_kv``/``write_kv``."""

    def __init__(self, spec: ModelSpec, weights: dict[str, torch.Tensor], *, max_batch: int = 8,
                 context: int = 512, num_sms: int = 8, dtype: torch.dtype = torch.float32):
        self.spec = spec
        self.max_batch, self.context, self.vocab_size = max_batch, context, spec.vocab_size
        sched = schedule(lower(spec, max_batch, context, num_sms), spec.name)
        # serving, not checking: no weight poison, no NaN scan (tests run the executor strictly)
        self.exe = CpuExecutor(sched, spec, weights, dtype=dtype, poison_weights=False, check=False)
        self._kv = [self.exe.kv_cache(i) for i in range(spec.num_layers)]  # each [B, G, ctx, D]
        self._prefill = Prefill(spec, self.exe.weights, act_dtype=dtype)

    def _slot_kv(self, slot: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(k[slot], v[slot]) for k, v in self._kv]

    def prefill(self, slot: int, token_ids: Sequence[int], start: int = 0) -> torch.Tensor:
        self._check_slot(slot)
        return self._prefill.run(token_ids, start, self._slot_kv(slot))

    def decode(self, slots: Sequence[int], tokens: Sequence[int], positions: Sequence[int]) -> torch.Tensor:
        for s in slots:
            self._check_slot(s)
        if len(set(slots)) != len(slots):
            raise ValueError(f"decode: slots {list(slots)} repeat a slot")
        tok = [0] * self.max_batch
        pos = [0] * self.max_batch
        for s, t, p in zip(slots, tokens, positions):
            tok[s], pos[s] = int(t), int(p)
        idle = [b for b in range(self.max_batch) if b not in set(slots)]
        saved = [(k[idle, :, 0].clone(), v[idle, :, 0].clone()) for k, v in self._kv] if idle else []
        logits, _ = self.exe.step(tok, pos)
        for (k, v), (ks, vs) in zip(self._kv, saved):
            k[idle, :, 0] = ks
            v[idle, :, 0] = vs
        return logits[list(slots)]

    def free(self, slot: int) -> None:
        self._check_slot(slot)  # the cache is simply overwritten by the next prefill

    def read_kv(self, slot: int, start: int, end: int) -> torch.Tensor:
        """[layers, 2, kv_heads, end - start, head_dim] copy of the slot's cache positions."""
        return torch.stack([torch.stack([k[slot, :, start:end], v[slot, :, start:end]]) for k, v in self._kv])

    def write_kv(self, slot: int, start: int, kv: torch.Tensor) -> None:
        n = kv.shape[3]
        for (k, v), x in zip(self._kv, kv):
            k[slot, :, start:start + n] = x[0]
            v[slot, :, start:start + n] = x[1]

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.max_batch:
            raise ValueError(f"slot {slot}: expected 0..{self.max_batch - 1}")
