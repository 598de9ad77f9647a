"""Serving backends: the engine's ``Backend`` over a step decoder that runs the compiled schedule.

A *step decoder* is anything with ``step(tokens [B], positions [B]) -> (logits [B, V], next [B])``
and ``kv_cache(layer) -> (k, v)``, each ``[B, kv_heads, context, head_dim]`` live tensors:
``CpuExecutor`` (the task list on the CPU) and ``CudaDecoder`` (the megakernel) both are.

``DecoderBackend`` adapts one to the engine. The schedule is compiled once for
``batch = max_batch``; each batch row is a slot. A decode step runs every row: rows not in the
step get a dummy token at position 0, and their position-0 K/V is saved before the step and put
back after it, so an idle row never changes any slot's cache (the attention of a row reads only
its own row; MoE routing weights of other rows are zero for it). Prefill is plain PyTorch
(``runtime/prefill.py``) writing the decoder's cache in place, on the cache's device.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from mkc.ir.lower import lower
from mkc.ir.spec import ModelSpec
from mkc.runtime.prefill import Prefill
from mkc.schedule.schedule import Schedule
from mkc.schedule.scheduler import schedule


class StepDecoder(Protocol):
    def step(self, tokens: Any, positions: Any) -> tuple[torch.Tensor, torch.Tensor]: ...

    def kv_cache(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]: ...


class DecoderBackend:
    """``Backend`` (runtime/engine.py) over a step decoder; also ``read_kv``/``write_kv`` (prefix cache).

    ``weights`` are the decoder's own copies (same device and dtype as its cache) and feed the
    prefill; ``act_dtype`` is the storage dtype of the decoder's "bf16" activations.
    """

    def __init__(self, decoder: StepDecoder, spec: ModelSpec, weights: dict[str, torch.Tensor], *,
                 max_batch: int, context: int, act_dtype: torch.dtype):
        self.decoder, self.spec = decoder, spec
        self.max_batch, self.context, self.vocab_size = max_batch, context, spec.vocab_size
        self._kv = [decoder.kv_cache(i) for i in range(spec.num_layers)]  # each [B, G, ctx, D]
        self._prefill = Prefill(spec, weights, act_dtype=act_dtype)

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
        for s, t, p in zip(slots, tokens, positions, strict=True):
            tok[s], pos[s] = int(t), int(p)
        busy = set(slots)
        idle = [b for b in range(self.max_batch) if b not in busy]
        saved = [(k[idle, :, 0].clone(), v[idle, :, 0].clone()) for k, v in self._kv] if idle else []
        logits, _ = self.decoder.step(tok, pos)
        for (k, v), (ks, vs) in zip(self._kv, saved, strict=False):
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
        for (k, v), x in zip(self._kv, kv, strict=True):
            k[slot, :, start:start + n] = x[0]
            v[slot, :, start:start + n] = x[1]

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.max_batch:
            raise ValueError(f"slot {slot}: expected 0..{self.max_batch - 1}")


def compile_schedule(spec: ModelSpec, max_batch: int, context: int, num_sms: int) -> Schedule:
    return schedule(lower(spec, max_batch, context, num_sms), spec.name)


class CpuBackend(DecoderBackend):
    """The CPU executor, without the oracle's weight poison and NaN scan (serving, not checking)."""

    def __init__(self, spec: ModelSpec, weights: dict[str, torch.Tensor], *, max_batch: int = 8,
                 context: int = 512, num_sms: int = 8, dtype: torch.dtype = torch.float32):
        from mkc.schedule.executor import CpuExecutor

        self.exe = CpuExecutor(compile_schedule(spec, max_batch, context, num_sms), spec, weights, dtype=dtype,
                               poison_weights=False, check=False)
        super().__init__(self.exe, spec, self.exe.weights, max_batch=max_batch, context=context, act_dtype=dtype)


class CudaBackend(DecoderBackend):
    """The megakernel (``runtime/cuda_backend.py: CudaDecoder``) on the current CUDA device, bf16.

    ``num_sms`` defaults to every SM of the device.
    """

    def __init__(self, spec: ModelSpec, weights: dict[str, torch.Tensor], *, max_batch: int = 8,
                 context: int = 4096, num_sms: int | None = None):
        from mkc.runtime.cuda_backend import CudaDecoder

        if num_sms is None:
            num_sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
        self.dec = CudaDecoder(compile_schedule(spec, max_batch, context, num_sms), spec, weights)
        names = [n for n, b in self.dec.schedule.buffers.items() if b.kind == "weight"]
        super().__init__(self.dec, spec, {n: self.dec.buffers[n] for n in names}, max_batch=max_batch,
                         context=context, act_dtype=torch.bfloat16)
