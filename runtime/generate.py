"""Greedy generation through the compiled task list (CPU executor) or the dense reference.

The prompt is fed token by token (token i at position i): every prompt token goes through the
same decode step as generated ones, which keeps this path an end-to-end test of lowering,
scheduling and the executor. A real prefill is the runtime's job.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable
from typing import TextIO

import torch

from mkc.ir.fp8 import weights_choice
from mkc.ir.spec import ModelSpec
from mkc.runtime.reference import DenseReference
from mkc.schedule.executor import CpuExecutor
from mkc.schedule.plan import plan

BACKENDS = ("cpu", "cuda", "reference")
MIN_CONTEXT = 64


def context_bucket(tokens: int) -> int:
    """The smallest power of two >= tokens, at least MIN_CONTEXT."""
    c = MIN_CONTEXT
    while c < tokens:
        c *= 2
    return c


class Progress:
    """How far a long generation is, on ``stream`` (stderr): steps done of all, tokens/s and the
    time left, the rate counted from the first step. Silent for the first ``after`` seconds (from
    its creation), so short runs print nothing; then a line at most every ``every`` seconds,
    rewritten in place on a terminal. Call it with the steps done after each step; ``close`` ends
    the line. ``clock`` is for tests."""

    def __init__(self, total_steps: int, *, batch: int = 1, context: int | None = None, stream: TextIO | None = None,
                 after: float = 3.0, every: float = 2.0, clock: Callable[[], float] = time.monotonic):
        self.total, self.batch, self.context = total_steps, batch, context
        self.stream = stream if stream is not None else sys.stderr
        self.after, self.every, self.clock = after, every, clock
        self.t0 = clock()
        self.last: float | None = None  # when a line was last printed
        self.first: tuple[float, int] | None = None  # (time, steps done) at the first call
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())

    def __call__(self, done: int) -> None:
        now = self.clock()
        if self.first is None:  # the rate counts from the first step, not from the set-up before it
            self.first = (now, done)
            return
        if now - self.t0 < self.after or (self.last is not None and now - self.last < self.every and done < self.total):
            return
        self.last = now
        t1, d1 = self.first
        rate = (done - d1) * self.batch / (now - t1) if now > t1 else 0.0
        left = (self.total - done) * self.batch / rate if rate > 0 else float("inf")
        ctx = f", context {self.context}" if self.context else ""
        line = (f"generate: {done}/{self.total} steps{ctx}, {rate:.1f} tokens/s"
                + (f", about {_duration(left)} left" if done < self.total else ", done"))
        self.stream.write(("\r" + line + "\x1b[K") if self.tty else line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty and self.last is not None:
            self.stream.write("\n")
            self.stream.flush()


def _duration(s: float) -> str:
    if s == float("inf"):
        return "an unknown time"
    if s < 120:
        return f"{s:.0f} s"
    return f"{s / 60:.0f} min" if s < 7200 else f"{s / 3600:.1f} h"


@contextlib.contextmanager
def _single_thread():
    """The executor runs thousands of tiny per-tile ops: torch's intra-op threads only add
    hand-off cost (~10x slower on 2 cores). Restores the caller's setting afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _check(spec: ModelSpec, prompts: list[list[int]], max_new_tokens: int, backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r}: expected one of {list(BACKENDS)}")
    if not 1 <= len(prompts) <= 8:
        raise ValueError(f"{len(prompts)} prompts: expected 1 to 8 (the batch sizes the lowering supports)")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens = {max_new_tokens}: expected at least 1")
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"prompt {i} is empty: expected at least one token id")
        bad = [t for t in p if not 0 <= t < spec.vocab_size]
        if bad:
            raise ValueError(f"prompt {i} has token ids {bad[:5]} outside [0, {spec.vocab_size})")


def greedy_generate_batch(spec: ModelSpec, weights: dict[str, torch.Tensor], prompts: list[list[int]],
                          max_new_tokens: int, *, dtype: torch.dtype = torch.float32, backend: str = "cpu",
                          context: int | None = None, num_sms: int = 8, seed: int | None = None,
                          poison_weights: bool = True, weights_format: str = "bf16",
                          progress: Callable[[int], None] | None = None) -> list[list[int]]:
    """Greedy-decode ``max_new_tokens`` for each prompt together (batch = len(prompts)).

    Every sequence advances one position per step, so a sequence with a shorter prompt starts
    generating earlier; a finished sequence keeps stepping on its last token (results ignored)
    until the longest is done. ``seed`` seeds the interleavings (step s uses seed + s).
    ``poison_weights=False`` skips the executor's poisoned weight copies (one full copy of a
    matrix per distinct tile: ~1 GB and ~10 s for a 135M model; the tiny tests keep it on).
    ``progress`` is called with the steps done after each step (e.g. a Progress).
    """
    _check(spec, prompts, max_new_tokens, backend)
    steps = max(len(p) for p in prompts) + max_new_tokens - 1
    ctx = context or context_bucket(steps + 1)
    if ctx < steps:
        raise ValueError(f"context {ctx} is too small for {steps} positions (longest prompt + max_new_tokens - 1)")
    B = len(prompts)
    lowering = weights_choice(weights_format)
    if backend == "cpu":
        sc = plan(spec, B, ctx, num_sms, **lowering)
        weights = _in_format(weights, sc, weights_format)
        ex = CpuExecutor(sc, spec, weights, dtype=dtype, poison_weights=poison_weights)

        def run(tokens: list[int], pos: int, i: int) -> list[int]:
            _, nxt = ex.step(tokens, [pos] * B, seed=None if seed is None else seed + i)
            return nxt.tolist()
    elif backend == "cuda":
        run = _cuda_runner(spec, weights, B, ctx, weights_format)
    else:
        ref = DenseReference(spec, weights)

        def run(tokens: list[int], pos: int, i: int) -> list[int]:
            return ref.step(tokens, [pos] * B).argmax(-1).tolist()

    out: list[list[int]] = [[] for _ in prompts]
    current = [p[0] for p in prompts]
    with _single_thread():
        for pos in range(steps):
            nxt = run(current, pos, pos)
            for b, p in enumerate(prompts):
                if pos + 1 < len(p):
                    current[b] = p[pos + 1]
                elif len(out[b]) < max_new_tokens:
                    out[b].append(nxt[b])
                    current[b] = nxt[b]
            if progress is not None:
                progress(pos + 1)
    return out


def _in_format(weights: dict[str, torch.Tensor], sc, fmt: str) -> dict[str, torch.Tensor]:
    """``weights`` for a schedule with weight format ``fmt``: FP8 matrices quantised from bf16 or
    float32 ones (runtime/quantize.py: fp8_weights) unless given already (their scales present)."""
    from mkc.ir.fp8 import SCALE_SUFFIX, is_fp8

    if not is_fp8(fmt) or any(k.endswith(SCALE_SUFFIX) for k in weights):
        return weights
    from mkc.runtime.quantize import fp8_weights

    return fp8_weights(weights, sc.buffers, fmt)


def gpu_memory_problem(spec: ModelSpec, batch: int, context: int, weights_format: str, free: int,
                       gpu: str) -> str | None:
    """The one-line error when the weights (in ``weights_format``) and the KV cache of ``batch``
    sequences of ``context`` positions need more than ``free`` bytes of the GPU, else None."""
    from mkc.runtime.bench import memory_estimate

    est = memory_estimate(spec, batch, context, weights_format=weights_format)
    need = est.weights + est.megakernel
    if need <= free:
        return None
    fp8 = " --weights fp8," if weights_format == "bf16" else ""
    return (f"{spec.name} needs {need / 1e9:.1f} GB on the GPU (weights {est.weights / 1e9:.1f} GB in "
            f"{weights_format}, KV cache {est.kv_cache / 1e9:.1f} GB, margin {est.margin / 1e9:.1f} GB); "
            f"{free / 1e9:.1f} GB are free on {gpu}: expected{fp8} a shorter --context, or a GPU with more memory")


def _cuda_runner(spec: ModelSpec, weights: dict[str, torch.Tensor], batch: int, context: int, fmt: str = "bf16"):
    """The megakernel for (batch, context) on the current GPU, one CTA per SM."""
    from mkc.runtime.cuda_backend import cuda_available

    if not cuda_available():
        raise ValueError("backend 'cuda': no usable CUDA GPU here: expected an H100/H200 (sm_90a)")
    problem = gpu_memory_problem(spec, batch, context, fmt, torch.cuda.mem_get_info()[0], torch.cuda.get_device_name())
    if problem:
        raise ValueError(problem)
    from mkc.runtime.cuda_backend import CudaDecoder

    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    sc = plan(spec, batch, context, sms, **weights_choice(fmt))
    # the decoder moves (and reorders) one weight at a time: the GPU never holds two copies
    dec = CudaDecoder(sc, spec, _in_format(weights, sc, fmt))

    def run(tokens: list[int], pos: int, i: int) -> list[int]:
        _, nxt = dec.step(tokens, [pos] * batch)
        return nxt.tolist()

    return run


def greedy_generate(spec: ModelSpec, weights: dict[str, torch.Tensor], prompt_ids: list[int], max_new_tokens: int,
                    *, dtype: torch.dtype = torch.float32, backend: str = "cpu", context: int | None = None,
                    num_sms: int = 8, seed: int | None = None, poison_weights: bool = True,
                    weights_format: str = "bf16", progress: Callable[[int], None] | None = None) -> list[int]:
    """Greedy-decode ``max_new_tokens`` after ``prompt_ids``; returns the generated ids only.

    Compiles for batch 1 and a context bucket (the next power of two >= prompt + new tokens, at
    least 64) unless ``context`` is given, then runs every token through the CPU executor
    (``backend="cpu"``), the megakernel on the GPU (``backend="cuda"``, bf16) or the dense
    reference (``backend="reference"``). ``weights_format``: the compiled step's (mkc/ir/fp8.py;
    FP8 matrices quantised from the weights given unless they are FP8 already).
    """
    return greedy_generate_batch(spec, weights, [list(prompt_ids)], max_new_tokens, dtype=dtype, backend=backend,
                                 context=context or context_bucket(len(prompt_ids) + max_new_tokens),
                                 num_sms=num_sms, seed=seed, poison_weights=poison_weights,
                                 weights_format=weights_format, progress=progress)[0]
