"""The CPU executor: runs a Schedule's task list with PyTorch, each task on its tile only.

It is the oracle for the GPU kernel and the executable proof that lowering + scheduling are
right, so it is deliberately suspicious of every task:

* **Poisoned reads.** A task runs on scratch copies of the buffers it touches in which every
  element outside its declared read regions is poison (a NaN, or a large negative integer). A
  task that reads an undeclared element computes garbage that the executor detects (a NaN in
  what it wrote, or an out-of-range index) and reports, naming the task.
* **Declared writes only.** After the task, only its declared write regions are copied back.
  A declared write region is a *may*-write set (a KV append declares the whole head, since the
  position is known only at run time): elements the task left untouched keep their previous
  value, as on the GPU. Untouched elements are recognised by a second bit pattern (a signalling
  NaN / another integer) that arithmetic never produces; a task copying poison verbatim is
  still caught because the read poison is a different pattern.
* **Counters.** Tasks run in an order the counters allow (semantics in ``schedule.py``):
  ``seed=None`` gives one fixed valid order, a seed picks at random among the SMs whose next
  task can start, so repeated steps exercise many interleavings.

Buffers: every non-weight buffer is owned here (the KV cache persists across steps). "bf16"
buffers are stored in the executor's activation dtype (bfloat16, or float32 for an exact
comparison with a float32 reference), "f32" in float32, "i32" in int32. Never-written elements
start as poison, so reading a KV position that no step has written is caught too.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from mkc.ir import fp8
from mkc.ir.graph import Buffer, Region, Task
from mkc.ir.kv_layout import identity_page_table, logical_view, page_size_of
from mkc.ir.spec import ModelSpec
from mkc.schedule.cpu_ops import run_task
from mkc.schedule.schedule import Schedule

INT_POISON = -(2 ** 30)  # int32 read poison: any index with it is out of range
INT_UNWRITTEN = -(2 ** 30) - 7  # int32 marker of a write-region element the task left alone

# Float poison bit patterns (as the signed integer of the same width). Read poison is a quiet
# NaN with a payload; the unwritten marker is a signalling NaN, which arithmetic never yields.
_F32_POISON = 0x7FC0DEAD
_F32_UNWRITTEN = 0x7F800BAD  # signalling NaN (quiet bit 22 clear)
_BF16_POISON = 0x7FDE
_BF16_UNWRITTEN = 0x7F8B  # signalling NaN (quiet bit 6 clear)


class ExecutorError(RuntimeError):
    """A task misbehaved or the schedule cannot proceed: the message names the task(s)."""


def _int_view(t: torch.Tensor) -> torch.Tensor:
    return t.view({torch.float32: torch.int32, torch.bfloat16: torch.int16}[t.dtype])


def _patterns(dtype: torch.dtype) -> tuple[int, int]:
    """(read poison, unwritten marker) as integers of the dtype's width."""
    if dtype == torch.float32:
        return _F32_POISON, _F32_UNWRITTEN
    if dtype == torch.bfloat16:
        return _BF16_POISON, _BF16_UNWRITTEN
    if dtype == torch.int32:
        return INT_POISON, INT_UNWRITTEN
    raise TypeError(f"no poison pattern for {dtype}")


def _filled(shape: tuple[int, ...], dtype: torch.dtype, pattern: int) -> torch.Tensor:
    if dtype == torch.int32:
        return torch.full(shape, pattern, dtype=torch.int32)
    out = torch.empty(shape, dtype=dtype)
    _int_view(out).fill_(pattern)
    return out


def _is_pattern(t: torch.Tensor, pattern: int) -> torch.Tensor:
    return (t if t.dtype == torch.int32 else _int_view(t)) == pattern


def _slices(box: tuple[tuple[int, int], ...]) -> tuple[slice, ...]:
    return tuple(slice(lo, hi) for lo, hi in box)


@dataclass(slots=True)
class _Plan:
    """Per task, what to materialise: buffer name → (read boxes, write boxes)."""

    touched: dict[str, tuple[list[tuple[slice, ...]], list[tuple[slice, ...]]]]
    weight_keys: dict[str, tuple]  # weight name → cache key of its poisoned view


class CpuExecutor:
    """Runs ``schedule`` step by step on the CPU.

    ``weights`` maps every weight buffer name of the schedule to a tensor of its shape (any float
    dtype; cast here once to the storage dtype). ``poison_weights`` also poisons weight elements
    outside the declared weight regions (cached per region, since weights never change).
    ``check`` raises ``ExecutorError`` as soon as a task writes a NaN (it read poison) instead of
    letting the NaN flow to the logits. After an ``ExecutorError`` the executor is mid-step
    (counters and buffers partly advanced): discard it.
    """

    def __init__(self, schedule: Schedule, spec: ModelSpec, weights: dict[str, torch.Tensor], *,
                 dtype: torch.dtype = torch.float32, poison_weights: bool = True, check: bool = True):
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"dtype {dtype}: expected torch.float32 or torch.bfloat16")
        self.schedule, self.spec, self.dtype = schedule, spec, dtype
        self.poison_weights, self.check = poison_weights, check
        self.steps = 0  # steps completed
        self.counters = [0] * len(schedule.counters)
        self.weights = self._load_weights(weights)
        self.bufs: dict[str, torch.Tensor] = {
            b.name: _filled(b.shape, self.storage_dtype(b), _patterns(self.storage_dtype(b))[0])
            for b in schedule.buffers.values() if b.kind != "weight"}
        self._plans = [self._plan(t) for t in schedule.tasks]
        self.page_size = page_size_of(schedule.buffers)
        if self.page_size:  # sequence b's pages are b * pages_per_seq + j until someone remaps them
            self.bufs["page_table"].copy_(identity_page_table(schedule.batch, schedule.context, self.page_size,
                                                    schedule.buffers["L0.k_cache"].shape[1]))
        self._weight_cache: dict[tuple, torch.Tensor] = {}

    # -- set-up ---------------------------------------------------------------------------------
    def storage_dtype(self, buf: Buffer) -> torch.dtype:
        # fp8: dequantised once, in float32 (mkc/ir/fp8.py)
        return {"bf16": self.dtype, "f32": torch.float32, "i32": torch.int32, "fp8": torch.float32}[buf.dtype]

    def _load_weights(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {}
        for b in self.schedule.buffers.values():
            if b.kind != "weight":
                continue
            if b.dtype == "fp8":
                out[b.name] = fp8.given(b.name, b.shape, self.schedule.meta.get("weights", "fp8"), weights).contiguous()
                continue
            out[b.name] = b.given(weights).detach().to(self.storage_dtype(b)).contiguous()
        return out

    def _plan(self, t: Task) -> _Plan:
        touched: dict[str, tuple[list, list]] = {}
        wregions: dict[str, list[Region]] = {}
        for r in t.reads:
            if self.schedule.buffers[r.buffer].kind == "weight":
                wregions.setdefault(r.buffer, []).append(r)
            else:
                touched.setdefault(r.buffer, ([], []))[0].append(_slices(r.box))
        for r in t.writes:
            if self.schedule.buffers[r.buffer].kind == "weight":
                raise ExecutorError(f"task {t.name} ({t.op.name}) declares a write to weight {r}: weights are immutable")
            touched.setdefault(r.buffer, ([], []))[1].append(_slices(r.box))
        for name in t.operands:
            if name != "-" and name not in touched and name not in wregions:
                # an operand without any declared region: the task gets all-poison (catches misuse)
                if self.schedule.buffers[name].kind == "weight":
                    wregions[name] = []
                else:
                    touched[name] = ([], [])
        weight_keys = {}
        for name, regions in wregions.items():
            boxes = [r.box for r in regions]
            weight_keys[name] = (name, tuple(sorted(boxes)))
        return _Plan(touched, weight_keys)

    def _weight_view(self, key: tuple) -> torch.Tensor:
        name, boxes = key
        w = self.weights[name]
        full = tuple((0, s) for s in w.shape)
        if not self.poison_weights or full in boxes:
            return w
        view = self._weight_cache.get(key)
        if view is None:
            view = _filled(tuple(w.shape), w.dtype, _patterns(w.dtype)[0])
            for bx in boxes:
                sl = _slices(bx)
                view[sl] = w[sl]
            self._weight_cache[key] = view
        return view

    # -- one task -------------------------------------------------------------------------------
    def run_one(self, t: Task) -> None:
        """Run task ``t`` on poisoned scratch copies and keep only its declared writes."""
        plan = self._plans[t.id]
        scratch: dict[str, torch.Tensor] = {}
        for name, (reads, writes) in plan.touched.items():
            real = self.bufs[name]
            poison, unwritten = _patterns(real.dtype)
            s = _filled(tuple(real.shape), real.dtype, poison)
            for sl in writes:
                _int_or_self(s[sl]).fill_(unwritten)
            for sl in reads:
                s[sl] = real[sl]
            scratch[name] = s
        weights = {name: self._weight_view(key) for name, key in plan.weight_keys.items()}
        try:
            run_task(t, scratch, weights, self.spec)
        except Exception as e:
            raise ExecutorError(f"task {t.id} {t.name} ({t.op.name}) failed: {type(e).__name__}: {e} "
                                f"(an index from poisoned data means it read outside its declared regions: "
                                f"{', '.join(map(str, t.reads))})") from e
        for name, (_, writes) in plan.touched.items():
            real, s = self.bufs[name], scratch[name]
            _, unwritten = _patterns(real.dtype)
            for sl in writes:
                src = s[sl]
                keep = ~_is_pattern(src, unwritten)
                if self.check and src.is_floating_point():
                    bad = torch.isnan(src) & keep
                    if bool(bad.any()):
                        where = tuple(int(i) + sl[d].start for d, i in enumerate(bad.nonzero()[0]))
                        raise ExecutorError(
                            f"task {t.id} {t.name} ({t.op.name}) wrote NaN into {name}{list(where)}: it read an "
                            f"element outside its declared read regions ({', '.join(map(str, t.reads))}) or one "
                            f"that no task has written yet")
                dst = real[sl]
                dst[keep] = src[keep]

    # -- one step -------------------------------------------------------------------------------
    def step(self, tokens, positions, *, seed: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode one token per sequence: returns (logits [B, vocab] float32, next_token [B] int64).

        ``tokens[b]`` is written to the KV cache at ``positions[b]`` of sequence b; the positions
        below it must have been written by earlier steps. ``seed`` picks the interleaving.
        """
        sc = self.schedule
        tokens = torch.as_tensor(tokens, dtype=torch.int32).reshape(-1)
        positions = torch.as_tensor(positions, dtype=torch.int32).reshape(-1)
        if tokens.numel() != sc.batch or positions.numel() != sc.batch:
            raise ValueError(f"step: got {tokens.numel()} tokens and {positions.numel()} positions: expected "
                             f"{sc.batch} (the schedule's batch)")
        if int(tokens.min()) < 0 or int(tokens.max()) >= self.spec.vocab_size:
            raise ValueError(f"step: token ids {tokens.tolist()} outside [0, {self.spec.vocab_size})")
        if int(positions.min()) < 0 or int(positions.max()) >= sc.context:
            raise ValueError(f"step: positions {positions.tolist()} outside [0, {sc.context}) (the context bucket)")
        self.bufs["tokens"].copy_(tokens)
        self.bufs["positions"].copy_(positions)
        self._run_queues(seed)
        self.steps += 1
        return self.bufs["logits"].float().clone(), self.bufs["next_token"].long().clone()

    def _run_queues(self, seed: int | None) -> None:
        sc = self.schedule
        step = self.steps + 1
        rng = random.Random(seed) if seed is not None else None
        heads = [0] * len(sc.queues)
        remaining = sum(len(q) for q in sc.queues)

        def ready(sm: int) -> bool:
            q = sc.queues[sm]
            if heads[sm] >= len(q):
                return False
            return all(self.counters[c] >= n * step for c, n in sc.waits[q[heads[sm]]])

        while remaining:
            runnable = [sm for sm in range(len(sc.queues)) if ready(sm)]
            if not runnable:
                raise ExecutorError(self._blocked_report(heads, step))
            if rng is None:  # fixed order: the runnable task first in program order
                sm = min(runnable, key=lambda i: sc.queues[i][heads[i]])
            else:
                sm = rng.choice(runnable)
            t = sc.tasks[sc.queues[sm][heads[sm]]]
            self.run_one(t)
            if sc.signals[t.id] >= 0:
                self.counters[sc.signals[t.id]] += 1
            heads[sm] += 1
            remaining -= 1

    def _blocked_report(self, heads: list[int], step: int) -> str:
        sc = self.schedule
        lines = []
        for sm, q in enumerate(sc.queues):
            if heads[sm] >= len(q):
                continue
            t = sc.tasks[q[heads[sm]]]
            unmet = [f"counter {c} = {self.counters[c]} < {n * step}" for c, n in sc.waits[t.id]
                     if self.counters[c] < n * step]
            lines.append(f"  SM {sm}: task {t.id} {t.name} waits on {', '.join(unmet)}")
        return f"deadlock in step {step}: no SM can run its next task\n" + "\n".join(lines)

    # -- KV cache access (prefill, tests) -----------------------------------------------------------
    def kv_cache(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Live (k, v) views of a layer's cache, [B, kv_heads, ctx, head_dim] (for a paged cache:
        under the identity page table, which the executor starts with; mkc/ir/kv_layout.py)."""
        sc = self.schedule
        return tuple(logical_view(self.bufs[f"L{layer}.{n}"], sc.batch, sc.context, self.page_size)
                     for n in ("k_cache", "v_cache"))  # type: ignore[return-value]

    def write_kv(self, seq: int, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Fill positions [0, n) of sequence ``seq`` of a layer (a prefill computed elsewhere);
        ``k``, ``v`` are [n, kv_heads, head_dim], post-RoPE keys as the model caches them."""
        n = k.shape[0]
        if n > self.schedule.context:
            raise ValueError(f"write_kv: {n} positions exceed the context bucket {self.schedule.context}")
        for name, x in (("k_cache", k), ("v_cache", v)):
            cache = self.bufs[f"L{layer}.{name}"]
            if self.page_size:  # through the page table, whatever it maps
                pos = torch.arange(n)
                pages = self.bufs["page_table"][seq].long()[pos // self.page_size]
                cache[:, pages, pos % self.page_size] = x.transpose(0, 1).to(cache.dtype)
            else:
                cache[seq, :, :n] = x.transpose(0, 1).to(cache.dtype)


def _int_or_self(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.int32 else _int_view(t)
