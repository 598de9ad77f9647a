"""``mkc bench``: decode step time of the megakernel beside a CUDA-graph PyTorch baseline.

Speed-of-light (docs/design.md): the bytes one step must read — active weights with the *distinct*
experts actually routed in that step, plus the KV cache actually attended (global layers: the
whole context; sliding layers: min(context, window)) — over the read bandwidth measured in the
same run. SOL fraction = SOL time / measured step time.
"""

from __future__ import annotations

import dataclasses
import datetime
import gc
import json
import math
import statistics
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TypeVar

import torch

from mkc.ir.kv_layout import pages_per_seq
from mkc.ir.spec import ModelSpec
from mkc.schedule.cost import H200, Ceilings, gpu_name

T = TypeVar("T")

BF16 = 2


def step_bytes(spec: ModelSpec, batch: int, context: int, routed: list[torch.Tensor]) -> int:
    """Bytes one decode step must read at ``context`` tokens per sequence (position context - 1).

    ``routed`` holds the [batch, top_k] expert ids of each MoE layer, in layer order.
    """
    a, H = spec.attention, spec.hidden_size
    total = batch * H * BF16  # embedding rows
    moe_layers = iter(routed)
    for ls in spec.layers:
        total += H * BF16  # norm
        total += ((a.num_heads + 2 * a.num_kv_heads) * a.head_dim * H + H * a.num_heads * a.head_dim) * BF16
        if a.qk_norm:
            total += 2 * a.head_dim * BF16
        if spec.block == "sequential":
            total += H * BF16
        keys = min(context, a.sliding_window) if ls.attention == "sliding" else context
        total += batch * keys * a.num_kv_heads * a.head_dim * 2 * BF16  # K and V attended
        if ls.mlp == "dense":
            total += 3 * spec.dense_intermediate * H * BF16
        else:
            m = spec.moe
            assert m is not None
            distinct = int(torch.unique(next(moe_layers)).numel())
            total += m.num_experts * H * BF16  # router
            total += distinct * 3 * m.intermediate * H * BF16
    total += H * BF16 + spec.vocab_size * H * BF16  # final norm, LM head
    return total


def measure_read_bandwidth(nbytes: int = 4 << 30, reps: int = 10) -> float:
    """Bytes/s of a torch sum over ``nbytes`` on the current GPU (the ceiling docs/design.md names)."""
    x = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    times = time_cuda(lambda: x.sum(dtype=torch.float32), reps=reps)
    return nbytes / statistics.median(times)


def time_cuda(fn, *, reps: int = 20, warmup: int = 3) -> list[float]:
    """Seconds per call of fn, CUDA events, after warm-up."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) / 1e3)
    return out


def graph_baseline(spec: ModelSpec, weights: dict[str, torch.Tensor], batch: int, context: int):
    """(step callable, decoder): the PyTorch decode step captured in a CUDA graph."""
    from mkc.runtime.torch_decode import TorchDecoder

    dec = TorchDecoder(spec, weights, batch, context, device="cuda", dtype=torch.bfloat16)
    tokens = torch.randint(0, spec.vocab_size, (batch,), device="cuda")
    positions = torch.full((batch,), context - 1, device="cuda", dtype=torch.long)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            dec.step(tokens, positions)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # the warm-ups' attention scratch, so the capture's pool is the only copy
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dec.step(tokens, positions)
    return graph.replay, dec


@dataclass
class Row:
    engine: str  # "mkc" | "torch+graph"
    batch: int
    context: int
    step_us: float  # median
    tok_s: float
    bytes: int  # the step had to read
    read_bw: float  # bytes/s measured in the same run
    sol_fraction: float
    # mkc: the step mkc compile's simulation predicts for the schedule timed, at this run's read
    # bandwidth (predicted_step_us), so each run checks the cost model; None for the baseline
    predicted_us: float | None = None


def predicted_step_us(sc, read_bw: float) -> float:
    """The step the shared-bandwidth simulation (mkc/schedule/simulate.py, what mkc compile reports)
    predicts for schedule ``sc`` at ``read_bw`` bytes/s, the H200's ceilings otherwise: a run's
    measured read bandwidth makes it the prediction for the card the run is on (an H100's steps at
    8K came within 1.8% of it, an H200's within 4.9%)."""
    from mkc.schedule.simulate import simulated_step_us

    return simulated_step_us(sc, dataclasses.replace(H200, read_bw=read_bw))


def row(engine: str, batch: int, context: int, times: list[float], nbytes: int, bw: float) -> Row:
    t = statistics.median(times)
    return Row(engine, batch, context, t * 1e6, batch / t, nbytes, bw, (nbytes / bw) / t)


@dataclass
class Skip:
    """An engine not run at a (batch, context) point: its memory estimate did not fit (or the GPU ran
    out of memory anyway)."""

    engine: str  # "mkc" | "torch+graph"
    batch: int
    context: int
    needed: int  # bytes it needed beside the weights (MemoryEstimate.megakernel / .baseline)
    free: int  # bytes free on the GPU when it was checked, the weights already loaded
    reason: str  # the whole line, as logged


def format_table(rows: list[Row | Skip]) -> str:
    head = f"{'engine':<12} {'batch':>5} {'context':>8} {'step µs':>9} {'tok/s':>8} {'GB read':>8} {'SOL':>6}"
    lines = [head, "-" * len(head)]
    for r in rows:
        if isinstance(r, Skip):
            lines.append(f"{r.engine:<12} {r.batch:>5} {r.context:>8}   skipped: needs "
                         f"{r.needed / 1e9:.1f} GB beside the weights, {r.free / 1e9:.1f} GB free")
            continue
        lines.append(f"{r.engine:<12} {r.batch:>5} {r.context:>8} {r.step_us:>9.1f} {r.tok_s:>8.1f} "
                     f"{r.bytes / 1e9:>8.3f} {r.sol_fraction:>6.1%}")
    return "\n".join(lines)


def write_json(rows: list[Row | Skip], path: str | Path, meta: dict) -> None:
    """``rows``: the timed points; ``skipped``: the engines not run, with the bytes needed and free."""
    Path(path).write_text(json.dumps({"meta": meta, "rows": [asdict(r) for r in rows if isinstance(r, Row)],
                                      "skipped": [asdict(r) for r in rows if isinstance(r, Skip)]}, indent=1))


# -- device memory ----------------------------------------------------------------------------------

MEMORY_MARGIN = 1 << 30  # activations (0.3 GB at batch 8 on North Mini Code), task words, workspaces


@dataclass(frozen=True)
class MemoryEstimate:
    """Device bytes one (batch, context) point of ``mkc bench`` needs. The megakernel and the
    baseline run one after the other over the same weights, so the peak is the larger of the two."""

    weights: int
    kv_cache: int  # the megakernel's, in its layout (paged: the pool and the page table)
    baseline_kv_cache: int  # the PyTorch baseline's (always contiguous)
    attention_scratch: int  # the baseline's attention, one layer at a time (see memory_estimate)
    margin: int = MEMORY_MARGIN

    @property
    def megakernel(self) -> int:
        """Bytes the megakernel needs beside the weights."""
        return self.kv_cache + self.margin

    @property
    def baseline(self) -> int:
        """Bytes the CUDA-graph baseline needs beside the weights."""
        return self.baseline_kv_cache + self.attention_scratch + self.margin

    @property
    def total(self) -> int:
        return self.weights + max(self.megakernel, self.baseline)


def memory_estimate(spec: ModelSpec, batch: int, context: int, page_size: int = 0) -> MemoryEstimate:
    """What ``mkc bench`` needs on the GPU at ``batch`` sequences of ``context`` positions.

    KV cache: K and V of every layer, ``kv_heads x head_dim`` bf16 per position, for the whole
    context bucket (sliding layers too). A paged cache (``page_size`` > 0) holds every page of every
    sequence (the identity page table), so it is never smaller than the contiguous one; it is larger
    by the last page's rounding and the page table. The baseline's attention scratch is the worst
    case of torch's SDPA, its math fallback (a boolean mask with grouped KV heads rules out flash
    attention): K and V of one layer widened to fp32, repeated per query head, and K scaled once more.
    """
    from mkc.runtime.weights import weight_shapes

    a = spec.attention
    position = 2 * spec.num_layers * a.num_kv_heads * a.head_dim * BF16  # K and V, all layers
    if page_size:
        pages = batch * pages_per_seq(context, page_size)
        kv = pages * page_size * position + pages * 4  # the pool; the page table (int32)
    else:
        kv = batch * context * position
    scratch = batch * context * a.head_dim * 4 * (2 * a.num_kv_heads + 3 * a.num_heads)
    weights = sum(math.prod(shape) for shape in weight_shapes(spec).values()) * BF16
    return MemoryEstimate(weights, kv, batch * context * position, scratch)


def memory_skip(est: MemoryEstimate, engine: str, free: int,
                contiguous: MemoryEstimate | None = None) -> str | None:
    """Why ``engine`` ("mkc" or "torch+graph") cannot run beside the loaded weights with ``free``
    bytes free, or None when it fits. ``contiguous``: the same point with a contiguous KV cache,
    named in the reason when it would fit where the paged one does not."""
    G = 1e9
    if engine == "mkc":
        need, parts = est.megakernel, f"KV cache {est.kv_cache / G:.1f} GB"
    else:
        need = est.baseline
        parts = (f"KV cache {est.baseline_kv_cache / G:.1f} GB + attention scratch "
                 f"{est.attention_scratch / G:.1f} GB")
    if need <= free:
        return None
    why = (f"{engine} needs {need / G:.1f} GB beside the {est.weights / G:.1f} GB of weights ({parts} + "
           f"{est.margin / G:.1f} GB margin), {free / G:.1f} GB free")
    if engine == "mkc" and contiguous is not None and contiguous.megakernel <= free:
        why += f"; the contiguous KV cache (--page-size 0) needs {contiguous.megakernel / G:.1f} GB and fits"
    return why


def free_memory() -> int:
    """Bytes free on the current GPU once torch has handed its cached blocks back to the driver."""
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info()[0]


# -- mkc bench ------------------------------------------------------------------------------------


def device_random_weights(spec: ModelSpec, seed: int, device: str = "cuda") -> dict[str, torch.Tensor]:
    """normal(0, 0.02) bf16 weights (norms 1 + normal(0, 0.05)) made on the device: North Mini
    Code's 61 GB take seconds on a GPU and would take many minutes on the host."""
    from mkc.runtime.weights import weight_shapes

    g = torch.Generator(device=device).manual_seed(seed)
    out = {}
    for name, shape in weight_shapes(spec).items():
        x = torch.randn(shape, device=device, dtype=torch.bfloat16, generator=g)
        out[name] = x.mul_(0.05).add_(1.0) if name.endswith("norm") else x.mul_(0.02)
    return out


def fill_random_kv(dec, spec: ModelSpec, generator: torch.Generator | None = None) -> None:
    """Every layer's KV cache of a decoder filled with normal(0, 1) values: the cache a benchmarked
    step attends to (``generator``: the same cache for every decoder of a comparison)."""
    for layer in range(spec.num_layers):
        for t in dec.kv_cache(layer):
            t.normal_(generator=generator)


def in_turn(options: Sequence[T], rounds: int) -> list[T]:
    """``options`` timed ``rounds`` times in turn, every other round in reverse order (A B B A ...),
    so that a place in the round weighs on every option alike: the first of two identical schedules
    in each round measured 0.6-2.6% slower than the second."""
    return [o for r in range(rounds) for o in (options if r % 2 == 0 else options[::-1])]


def format_rounds(batch: int, times_us: dict[str, list[float]]) -> str:
    """One batch's variants timed in turn (in_turn), side by side: per variant the step time of
    each of its rounds (µs, in the order they ran), their mean and the mean's change against the
    first variant's, so that a comparison is read off one table rather than worked out from the
    log's lines."""
    times_us = {name: ts for name, ts in times_us.items() if ts}
    if not times_us:
        return f"batch {batch}: no variant timed"
    base_name, base = next(iter(times_us.items()))
    base_mean = statistics.fmean(base)
    width = max(len(n) for n in times_us)
    lines = [f"batch {batch} side by side (µs per round, in the order run; the mean's change against {base_name}):"]
    for name, ts in times_us.items():
        mean = statistics.fmean(ts)
        change = "" if name == base_name else f"  {100 * (mean / base_mean - 1):+.1f}%"
        lines.append(f"  {name:<{width}}  {' / '.join(f'{t:.1f}' for t in ts)}  mean {mean:.1f}{change}")
    return "\n".join(lines)


def bench_tokens(spec: ModelSpec, batch: int) -> torch.Tensor:
    """The [batch] token ids every benchmark step of a batch size decodes (seeded by the batch)."""
    return torch.randint(0, spec.vocab_size, (batch,), dtype=torch.int32,
                         generator=torch.Generator().manual_seed(batch))


def fill_bench_kv(dec, spec: ModelSpec) -> None:
    """The decoder's KV cache as every benchmark of its (batch, context) point fills it (seeded)."""
    sc = dec.schedule
    fill_random_kv(dec, spec, torch.Generator(device="cuda").manual_seed(sc.batch * 100003 + sc.context))


@contextmanager
def decoder_in_place(sc, spec: ModelSpec, weights: dict[str, torch.Tensor], *, options=None,
                     artifact=None) -> Iterator:
    """A CudaDecoder for schedule ``sc`` over ``weights`` (on the GPU), with the kernel's GEMV
    weights put into tile order in their own storage for the block and back to row-major after it:
    the weights are held once (a tile-ordered copy of North Mini Code's 61 GB does not fit beside
    a long context's KV cache). The decoder is closed at the end of the block, its memory handed
    back, and must not be used after it."""
    from mkc.codegen import build_kernel
    from mkc.codegen.weight_tiles import tile_ordered_in_place, tiled_weights
    from mkc.runtime.cuda_backend import CudaDecoder

    art = artifact or build_kernel(sc, spec, options)
    with tile_ordered_in_place(weights, tiled_weights(sc) if art.config.weights_tiled else ()) as tw:
        dec = CudaDecoder(sc, spec, tw, artifact=art)
        try:
            yield dec
        finally:
            dec.close()  # lets go of its buffers: the caller's name for it outlives the block
            torch.cuda.empty_cache()


def time_step(dec, spec: ModelSpec, batch: int, context: int, bw: float, reps: int) -> tuple[float, float, list[float]]:
    """Time ``reps`` launches of a decoder whose inputs are in place (after 2 warm-ups): the median
    step (s), its speed-of-light fraction (the distinct experts it routed, read bandwidth ``bw``)
    and every time."""
    times = time_cuda(dec.launch, reps=reps, warmup=2)
    dec.check()
    routed = [dec.buffers[f"L{i}.moe_selected"] for i, ls in enumerate(spec.layers) if ls.mlp == "moe"]
    med = statistics.median(times)
    return med, step_bytes(spec, batch, context, routed) / bw / med, times


def run_bench(spec: ModelSpec, weights: dict[str, torch.Tensor], batches: list[int], contexts: list[int], *,
              reps: int = 20, profile_dir: Path | None = None, page_size: int = 0, tune: bool = False,
              tune_rounds: int = 1, tune_tiles: bool = False, tune_every_count: bool = False,
              log=print) -> list[Row | Skip]:
    """Megakernel and CUDA-graph PyTorch baseline, side by side, per (batch, context); the
    megakernel's KV cache paged when ``page_size`` > 0 (under the identity page table). With
    ``tune``, each point first times every attention-SM count (tune_attention_sms); the fastest
    count's run is the megakernel row (with ``profile_dir``, that count runs again, profiled);
    ``tune_rounds``, ``tune_tiles``, ``tune_every_count``: as tune_attention_sms's ``rounds``,
    ``tiles`` and ``every_count``.

    Before each engine allocates anything its memory estimate (memory_estimate) is compared with
    the GPU's free memory: an engine that does not fit is skipped with a Skip saying what it needed
    and what was free (as is one that runs out of memory anyway), and the other points still run."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    bw = measure_read_bandwidth()
    log(f"read bandwidth {bw / 1e12:.2f} TB/s (torch sum over 4 GiB, this run)")
    out: list[Row | Skip] = []
    for batch in batches:
        for context in contexts:
            est = memory_estimate(spec, batch, context, page_size)
            contiguous = memory_estimate(spec, batch, context) if page_size else None
            for engine in ("mkc", "torch+graph"):
                free = free_memory()
                why = memory_skip(est, engine, free, contiguous)
                need = est.megakernel if engine == "mkc" else est.baseline
                if why is None:
                    try:
                        if engine == "mkc":
                            tuned = _tune(spec, weights, batch, context, sms=sms, bw=bw, reps=reps,
                                          page_size=page_size, log=log, rounds=tune_rounds,
                                          tiles=tune_tiles, every_count=tune_every_count) if tune else None
                            if tuned and profile_dir is None:  # the fastest count's run is the row
                                for line in tuned[2]:
                                    log(line)
                                out.append(tuned[1])
                            else:
                                out.append(_megakernel_row(spec, weights, batch, context, sms=sms, bw=bw,
                                                           reps=reps, page_size=page_size,
                                                           profile_dir=profile_dir, log=log))
                        else:
                            out.append(_baseline_row(spec, weights, batch, context, bw=bw, reps=reps))
                        continue
                    except torch.cuda.OutOfMemoryError as e:
                        why = (f"{engine} ran out of device memory although its estimate "
                               f"({need / 1e9:.1f} GB) fit in {free / 1e9:.1f} GB free: {str(e).splitlines()[0]}")
                    gc.collect()  # the failed engine's tensors, held by its traceback's frames
                    torch.cuda.empty_cache()
                out.append(Skip(engine, batch, context, need, free, why))
                log(f"batch {batch} context {context}: skipped: {why}")
            m, b = out[-2], out[-1]
            if isinstance(m, Row) and isinstance(b, Row):
                log(f"batch {batch} context {context}: mkc {m.step_us:.1f} µs ({m.sol_fraction:.1%} SOL), "
                    f"torch+graph {b.step_us:.1f} µs ({b.sol_fraction:.1%} SOL), speed-up {b.step_us / m.step_us:.2f}x")
    return out


# Two counts of attention SMs whose whole-model times differ by at most this fraction are a tie
# for mkc bench --tune: the same schedule's median moves by 1-2% between runs. Tied counts are all
# tried with the global layers' splits (batch 1 at 128K: 0 attention SMs timed 0.3% faster than
# 64 alone, but 64 with more global splits ran 7% faster than 0 with them).
TUNE_TIE = 0.02
# mkc bench --tune does not time an attention-SM count whose probe step under the shared-bandwidth
# simulation (plan.py: choose_attention_sms) is more than this fraction slower than the fastest
# count's (unless asked to time every count). Over the 11 points of configs/tuning/h200.json, the
# measured fastest count's simulated probe step was at most 6.9% above the fastest simulated (batch
# 1 at 128K; batch 4 at 128K 0.7%, the others 0), while the 20 counts this leaves out had measured
# 1.33-7.0x the fastest (batch 1 at 8K: 4 and 8 attention SMs; at 32K 4, 8 and 16; at 128K 4, 8,
# 16 and 32; none at batch 4 and 8 at 8K). Each count left out saves a kernel build and its timed
# steps (~20 s, more at long contexts).
TUNE_SIMULATED_MARGIN = 0.25


def tune_attention_sms(spec: ModelSpec, weights: dict[str, torch.Tensor], batch: int, context: int, *, sms: int,
                       bw: float, reps: int, page_size: int = 0, log=print, rounds: int = 1,
                       tiles: bool = False, every_count: bool = False) -> int | None:
    """Time the megakernel with every attention-SM count the planner considers at this point
    (mkc/schedule/plan.py) and record the fastest (mkc/schedule/tuning.py); None when there is
    only one candidate. Unless ``every_count``, the counts whose simulated probe step is more than
    TUNE_SIMULATED_MARGIN above the fastest count's are left out (the entry records their
    simulated steps). Every count runs the same tokens and KV cache. The fastest count is then
    timed with the attention splits' inputs ranked first (Ceilings.attention_inputs_first_us),
    and with the splits ranked first too (Ceilings.splits_first), each where that places anything
    differently, and the fastest of these is recorded with it; then the same with a layer's sibling
    tiles spread over SMs (Ceilings.spread_siblings); last, the chosen schedule lowered with the
    residual added by the O-projection (LowerOptions.residual_in_o_proj), then with more splits in
    the layers of global attention (LowerOptions.global_attention_sms) where they attend more keys
    than the sliding windows. With ``rounds`` > 1 each
    decision times its options in turn that many times, the option chosen before included, and
    compares medians (the entry's measured times are those medians). With ``tiles``, last, the
    expert tiles' rows (expert_tile_candidates): each slot's gate/up tiles, then the expert-down
    tiles with the gate/up tiles chosen; else an entry's rows that another tool measured stay, and
    every schedule is timed with them."""
    best = _tune(spec, weights, batch, context, sms=sms, bw=bw, reps=reps, page_size=page_size, log=log,
                 rounds=rounds, tiles=tiles, every_count=every_count)
    return best[0] if best else None


def _tune(spec: ModelSpec, weights: dict[str, torch.Tensor], batch: int, context: int, *, sms: int, bw: float,
          reps: int, page_size: int, log, rounds: int = 1, tiles: bool = False,
          every_count: bool = False) -> tuple[int, Row, list[str]] | None:
    """tune_attention_sms, also returning the fastest count's row and the lines its run logged
    (so that mkc bench --tune reports that run instead of timing the count again)."""
    from mkc.codegen import CodegenError
    from mkc.ir.spec import SpecError
    from mkc.schedule import tuning
    from mkc.schedule.plan import (
        DEFAULT_LOWERING,
        EXPERT_DOWN_ROWS,
        EXPERT_UP_ROWS,
        GLOBAL_ATTENTION_SMS,
        INPUTS_FIRST,
        INPUTS_FIRST_CANDIDATES,
        KEPT_OVER_RETUNE,
        RESIDUAL_IN_O_PROJ,
        SPLITS_FIRST,
        SPLITS_FIRST_KEY,
        SPREAD,
        attention_sms_candidates,
        choose_attention_sms,
        global_attention_sms_candidates,
        plan,
        plan_choices,
    )

    every = candidates = attention_sms_candidates(spec, batch, sms)
    if len(candidates) == 1:
        return None
    not_timed: dict[int, float] = {}  # count -> its simulated probe step (µs), where left out
    if not every_count:
        _, simulated = choose_attention_sms(spec, batch, context, sms, page_size=page_size)
        fastest = min(simulated.values())
        not_timed = {a: t for a, t in simulated.items() if t > fastest * (1 + TUNE_SIMULATED_MARGIN)}
        for a, t in not_timed.items():
            log(f"batch {batch} context {context}: {a} attention SMs not timed: its simulated probe step, "
                f"{t:.1f} µs, is {t / fastest - 1:.0%} above the fastest count's ({fastest:.1f} µs; "
                f"more than {TUNE_SIMULATED_MARGIN:.0%})")
        candidates = [a for a in candidates if a not in not_timed]
    # A schedule is (count, raise µs, splits raised too, sibling spread, residual in the O-projection,
    # the global-attention layers' count).
    # Every decision below compares some of them: with one round each is timed once (a schedule timed
    # before is not timed again); with more, every option of the decision, the one chosen before
    # included, is timed once per round in turn, and the medians decide (drift between rounds falls
    # on every option alike).
    times: dict[tuple, list[float]] = {}
    runs: dict[tuple, tuple[Row, list[str]]] = {}

    def ceilings_of(raise_us: float, splits: bool, spread_on: bool) -> Ceilings:
        return dataclasses.replace(H200, attention_inputs_first_us=raise_us, splits_first=splits,
                                   spread_siblings=spread_on)

    def time_once(key: tuple, what: str) -> None:
        a, raise_us, splits, spread_on = key[:4]
        lines: list[str] = []
        r = _megakernel_row(spec, weights, batch, context, sms=sms, bw=bw, reps=reps, page_size=page_size,
                            profile_dir=None, log=lines.append, attention_sms=a, predict=False,
                            ceilings=ceilings_of(raise_us, splits, spread_on), **time_lowering(key))
        times.setdefault(key, []).append(r.step_us)
        runs[key] = (r, lines)
        log(f"batch {batch} context {context}: {what}: {r.step_us:.1f} µs ({r.sol_fraction:.1%} SOL)")

    def median(key: tuple) -> float:
        return statistics.median(times[key])

    def decide(options: dict[tuple, str]) -> None:
        again = rounds > 1 and len(options) > 1  # one option is nothing to compare
        for key in in_turn(list(options), rounds if again else 1):
            if again or key not in times:
                time_once(key, options[key])

    key = tuning.tuning_key(spec, batch, context, sms, page_size)
    # The entry measured at this point before this tune (not one moved from another context): its
    # schedule is timed against the tune's choice at the end, in turn, and stays unless the tune's
    # is faster (see keep_the_faster).
    entry_before = tuning.lookup(key)
    a0, c0, how0 = plan_choices(spec, batch, context, sms, page_size) if entry_before else (0, H200, {})
    measured_here = how0.get("chosen_by") == "measured" and "measured_at_context" not in how0
    # its expert tile rows as the planner applies them
    rows_before = (tuple(how0.get(EXPERT_UP_ROWS, ())), int(how0.get(EXPERT_DOWN_ROWS, 0)))
    incumbent: tuple | None = (a0, c0.attention_inputs_first_us, c0.splits_first, c0.spread_siblings,
                               bool(how0.get(RESIDUAL_IN_O_PROJ)), int(how0.get(GLOBAL_ATTENTION_SMS, 0)),
                               *rows_before) if measured_here else None
    # what another tool measured and this tune does not time (the expert tiles' rows, plan.py) stays
    rows_kept = {k: v for k, v in (entry_before or {}).items() if k.startswith((EXPERT_DOWN_ROWS, EXPERT_UP_ROWS))}
    # and every schedule below is timed with those rows, so that the entry records a schedule that ran
    # (a re-tune timed with the rule's rows and recorded beside another tool's ran 2.9% slower than
    # its old entry). With ``tiles`` the rows are timed last, from the rule's.
    kept_rows: tuple = () if tiles or not rows_kept else rows_before

    def sched(*choices) -> tuple:
        """A schedule key: (count, raise µs, splits raised too, spread, residual in the O-projection,
        global layers' SMs' worth) and the rows kept."""
        return (*choices, *kept_rows)

    decided: dict[str, object] = {}  # the entry so far: each decision is recorded as it is made

    def record(done: str | None, **choices) -> Path:
        """Record the decisions so far (``done``: the last one, while more are to come), so that a
        tune stopped part-way (a time limit, ^C) keeps what it measured; the rest stays the planner's."""
        decided.update(choices)
        by = {} if done is None else {"by": f"mkc bench --tune, stopped after {done} (the rest: the planner's own)"}
        return tuning.record(key, {**rows_kept, **decided, **by, "gpu": torch.cuda.get_device_name(0), "reps": reps,
                                   "rounds": rounds, "lowering": dict(DEFAULT_LOWERING),
                                   "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")})

    def with_rows(k: tuple) -> tuple:
        """A schedule key with its rows written out (the rule's: (), 0), to compare two keys."""
        return (*k[:6], *(k[6:] or ((), 0)))

    def keep_the_faster(before: tuple, chosen_key: tuple, turns: int) -> dict | None:
        """Time the entry's schedule ``before`` and the tune's ``chosen_key`` in turn, ``turns`` times
        each; None where the tune's is faster (by the medians of these runs alone: the tune's earlier
        run was the fastest of its options, so it is biased low), else what the entry records of it.
        Re-tunes of one round had chosen schedules that ran 2.9% (batch 8 at 8K) and 0.8% (batch 4 at
        128K) slower than the entries they replaced."""
        fresh: dict[tuple, list[float]] = {before: [], chosen_key: []}
        what = {before: "the entry measured before this tune", chosen_key: "the tune's choice"}
        try:
            for k in in_turn([before, chosen_key], turns):
                time_once(k, what[k] + ", side by side")
                fresh[k].append(times[k][-1])
        except (CodegenError, SpecError) as e:  # the old entry no longer builds: the tune's stays
            log(f"batch {batch} context {context}: the entry measured before this tune cannot be built: {e}")
            return None
        entry_us, retuned_us = statistics.median(fresh[before]), statistics.median(fresh[chosen_key])
        if retuned_us < entry_us:
            return None
        # the GPU these runs were on: a shipped entry may have been measured on another card (the key
        # names none), and the side by side holds for this one
        return {"date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
                "gpu": torch.cuda.get_device_name(0), "entry_us": round(entry_us, 1),
                "retuned_us": round(retuned_us, 1), "runs": turns, "retuned": describe(chosen_key)}

    decide({sched(a, 0.0, False, False, False, 0): f"{a} attention SMs" for a in candidates})
    measured = {a: median(sched(a, 0.0, False, False, False, 0)) for a in candidates}
    best = min(candidates, key=lambda a: (measured[a], a))
    record("the attention SMs", attention_sms=best, measured_us={str(a): round(t, 1) for a, t in measured.items()},
           **({"not_timed_simulated_us": {str(a): t for a, t in not_timed.items()}} if not_timed else {}))
    # then the fastest count with each priority raise of the attention splits' inputs (and of the
    # splits too), and then with the chosen raise and a layer's sibling tiles spread over SMs
    # (Ceilings.attention_inputs_first_us, splits_first, spread_siblings): each timed only where it
    # places the tasks differently from every placement timed before it. A raise is (µs, splits too).
    placed: dict[tuple[float, bool, bool], list[list[int]]] = {}

    def queues(*choice) -> list[list[int]]:
        if choice not in placed:
            placed[choice] = plan(spec, batch, context, sms, page_size=page_size, attention_sms=best,
                                  ceilings=ceilings_of(*choice), **time_lowering(sched(best, *choice, False, 0))).queues
        return placed[choice]

    raises = [(us, False) for us in INPUTS_FIRST_CANDIDATES] + [(INPUTS_FIRST_CANDIDATES[-1], True)]
    kept = [raises[0]]  # each placed otherwise than every raise before it
    for us, splits in raises[1:]:
        if not any(queues(us, splits, False) == queues(*r, False) for r in kept):
            kept.append((us, splits))
    decide({sched(best, us, splits, False, False, 0): (f"{best} attention SMs" if not us else
                                               f"{best} attention SMs, the splits' inputs"
                                               + (" and the splits" if splits else "") + f" ranked {us:g} µs higher")
            for us, splits in kept})
    first = {r: median(sched(best, *r, False, False, 0)) for r in kept}
    raise_us, splits_first = min(first, key=lambda r: (first[r], r))
    record("the splits' inputs' raise", **{
        INPUTS_FIRST: raise_us, SPLITS_FIRST: splits_first,
        INPUTS_FIRST + "_measured_us": {(SPLITS_FIRST_KEY if splits else f"{us:g}"): round(t, 1)
                                         for (us, splits), t in first.items()}})
    spread_keys = {False: sched(best, raise_us, splits_first, False, False, 0)}
    if queues(raise_us, splits_first, True) != queues(raise_us, splits_first, False):
        spread_keys[True] = sched(best, raise_us, splits_first, True, False, 0)
    decide({k: ("the same with sibling tiles spread over SMs" if on else "the same, sibling tiles not spread")
            for on, k in spread_keys.items()})
    spread = {on: median(k) for on, k in spread_keys.items()}
    spread_on = min(spread, key=lambda on: (spread[on], on))
    record("the sibling spread", **{
        SPREAD: spread_on, SPREAD + "_measured_us": {("on" if on else "off"): round(t, 1) for on, t in spread.items()}})
    # last, the O-projection ending the layer (LowerOptions.residual_in_o_proj): another lowering,
    # so another placement, always timed
    unfolded, folded = (sched(best, raise_us, splits_first, spread_on, on, 0) for on in (False, True))
    fold_keys = {False: unfolded}
    try:
        decide({unfolded: "the same, residual tiles", folded: "the same with the residual added by the O-projection"})
    except (CodegenError, SpecError) as e:  # e.g. its residual terms do not fit the shared memory
        log(f"batch {batch} context {context}: the residual added by the O-projection cannot be built here: {e}")
    else:
        fold_keys[True] = folded
    fold = {on: median(k) for on, k in fold_keys.items()}
    fold_on = min(fold, key=lambda on: (fold[on], on))
    record("the residual in the O-projection", **{
        RESIDUAL_IN_O_PROJ: fold_on,
        RESIDUAL_IN_O_PROJ + "_measured_us": {("on" if on else "off"): round(t, 1) for on, t in fold.items()}})
    # then the splits of the layers of global attention (LowerOptions.global_attention_sms), where
    # they attend more keys than the sliding windows: another lowering, always timed. The count
    # chosen so far is the one the whole model ran fastest with, which at a long context the global
    # layers decide; so the sliding layers are also timed on the next smaller count, beneath 2, 4
    # and 8 times that in the global layers (a pair (attention SMs, global layers' SMs' worth)).
    # A count that ran within TUNE_TIE of the chosen one is a tie the run's noise may have broken
    # either way, and more splits in the global layers may favour it: its pairs are timed too.
    pairs = [(best, w) for w in global_attention_sms_candidates(spec, batch, context, sms, best)]
    if len(pairs) > 1:
        # (the next smaller count of all, though left out of the first times: beneath the global
        # layers' splits it is another schedule; batch 1 at 128K measured fastest so)
        smaller = max((a for a in every if 0 < a < best), default=0)
        tied = [a for a in candidates if a != best and measured[a] <= measured[best] * (1 + TUNE_TIE)]
        for a in sorted(set(tied) | ({smaller} if smaller else set()), key=every.index):
            pairs += [(a, w) for w in global_attention_sms_candidates(spec, batch, context, sms, a) if w]
    wide_keys = {(a, w): sched(a, raise_us, splits_first, spread_on, fold_on, w) for a, w in pairs}
    decide({k: ("the same, as many splits in the layers of global attention" if not w else
                f"the same with {w} SMs' worth of splits in the layers of global attention"
                + (f" and {a} attention SMs" if a != best else "")) for (a, w), k in wide_keys.items()})
    wide = {pair: median(k) for pair, k in wide_keys.items()}
    # ties: fewer splits in the global layers, then the count chosen first
    chosen, wide_sms = min(wide, key=lambda p: (wide[p], p[1], p[0] != best))
    final = wide_keys[chosen, wide_sms]
    wide_entry = {
        "attention_sms": chosen, GLOBAL_ATTENTION_SMS: wide_sms,
        # "W": with the count chosen first; "W@A": with A attention SMs
        GLOBAL_ATTENTION_SMS + "_measured_us": {(f"{w}" if a == best else f"{w}@{a}"): round(t, 1)
                                                for (a, w), t in wide.items()}}
    tile_choice = expert_tile_candidates(plan(spec, batch, context, sms, page_size=page_size, attention_sms=chosen,
                                              ceilings=ceilings_of(raise_us, splits_first, spread_on),
                                              **time_lowering(final))) if tiles else None
    if tile_choice:
        # last, the expert tiles' rows: each slot's gate/up tiles, then (with those) the expert-down tiles
        ups, downs = tile_choice
        up_keys = {up: (*final, up, 0) for up in ups}
        times[up_keys[()]], runs[up_keys[()]] = list(times[final]), runs[final]  # the rule's: timed above
        decide({k: "the same, the rule's expert gate/up tiles" if not up else
                f"the same with each slot's expert gate/up tiles of {tuning.rows_label(up)} rows" for up, k in up_keys.items()})
        up_us = {up: median(k) for up, k in up_keys.items()}
        up_rows = min(ups, key=lambda up: (up_us[up], up != ()))
        down_keys = {down: (*final, up_rows, down) for down in downs}
        decide({k: "the same, the rule's expert-down tiles" if not down else
                f"the same with expert-down tiles of {down} rows" for down, k in down_keys.items()})
        down_us = {down: median(k) for down, k in down_keys.items()}
        down_rows = min(downs, key=lambda down: (down_us[down], down != 0))
        final = down_keys[down_rows]
        record("the global layers' splits", **wide_entry)  # still with another tool's rows, replaced below
        rows_kept = {
            EXPERT_UP_ROWS: list(up_rows), EXPERT_UP_ROWS + "_by": "mkc bench --tune --tune-tiles",
            EXPERT_UP_ROWS + "_measured_us": {tuning.rows_label(up) if up else "rule": round(t, 1) for up, t in up_us.items()},
            EXPERT_DOWN_ROWS: down_rows, EXPERT_DOWN_ROWS + "_by": "mkc bench --tune --tune-tiles",
            EXPERT_DOWN_ROWS + "_measured_us": {str(down): round(t, 1) for down, t in down_us.items()}}
    path = record(None, **wide_entry)
    if incumbent is not None and with_rows(incumbent) != with_rows(final):
        kept = keep_the_faster(incumbent, final, max(rounds, 2))
        if kept:
            path = tuning.record(key, {**entry_before, KEPT_OVER_RETUNE: kept})
            log(f"batch {batch} context {context}: the entry measured before this tune stays: side by side, in turn, "
                f"{kept['entry_us']:.1f} µs against {kept['retuned_us']:.1f} µs for the tune's choice "
                f"(medians of {kept['runs']} runs each); recorded in {path}")
            return incumbent[0], *runs[incumbent]
    log(f"batch {batch} context {context}: fastest with {describe(final)}; recorded in {path}")
    return chosen, *runs[final]


def describe(key: tuple) -> str:
    """A tuning schedule key (time_lowering's) in words, as mkc bench --tune logs its choice."""
    from mkc.schedule import tuning

    a, raise_us, splits, spread, fold, wide, *rows = key
    up, down = rows or ((), 0)
    parts = [f"{a} attention SMs"]
    if raise_us:
        parts.append(f"the splits' inputs{' and the splits' if splits else ''} ranked {raise_us:g} µs higher")
    parts += (["sibling tiles spread over SMs"] if spread else []) + (["the residual added by the O-projection"]
                                                                     if fold else [])
    parts += [f"{wide} SMs' worth of splits in the layers of global attention"] if wide else []
    parts += [f"expert gate/up tiles of {tuning.rows_label(up)} rows"] if up else []
    parts += [f"expert-down tiles of {down} rows"] if down else []
    return " and ".join(parts)


def time_lowering(key: tuple) -> dict:
    """The lowering choices of a tuning schedule key (count, raise, splits, spread, residual in the
    O-projection, global layers' splits[, gate/up rows, down rows: with --tune-tiles, or an entry's
    kept; () and 0 are the rule's]) beside its count and ceilings: those that differ from the default
    lowering."""
    from mkc.schedule.plan import EXPERT_DOWN_ROWS, EXPERT_UP_ROWS, GLOBAL_ATTENTION_SMS, RESIDUAL_IN_O_PROJ

    _, _, _, _, fold, wide, *rows = key
    up, down = rows or ((), 0)
    return {**({RESIDUAL_IN_O_PROJ: True} if fold else {}), **({GLOBAL_ATTENTION_SMS: wide} if wide else {}),
            **({EXPERT_UP_ROWS: up} if up else {}), **({EXPERT_DOWN_ROWS: down} if down else {})}


def expert_tile_candidates(sc) -> tuple[list[tuple[int, ...]], list[int]] | None:
    """The expert tiles' rows mkc bench --tune --tune-tiles times at a point, from the schedule ``sc``
    planned with the rule's tiles: each slot's gate/up rows in the rule's count of equal tiles (``()``,
    first), in half as many, 1.5 and 2 times as many (equal tiles of a multiple of 16 rows only); and
    the expert-down tiles' rows: the rule's (0, first), half, a quarter and twice them (multiples of
    16, at most the hidden size). None where the schedule has no expert gate/up and down tiles (a
    dense model, fused expert tiles). North Mini Code ran faster with 1.5 times as many gate/up tiles
    at batch 4 and a quarter of the down rows at 8."""
    up = [t for t in sc.tasks if t.op.name == "EXPERT_SWIGLU"]
    down = [t for t in sc.tasks if t.op.name == "EXPERT_DOWN"]
    if not up or not down:
        return None
    first = min((t.layer, int(t.arg("slot"))) for t in up)
    rule_up = [int(t.arg("rows")) for t in up if (t.layer, int(t.arg("slot"))) == first]
    inter, n = sum(rule_up), len(rule_up)
    ups: list[tuple[int, ...]] = [()]
    for count in (n // 2, n * 3 // 2, n * 2):
        if count >= 1 and count != n and inter % count == 0 and (inter // count) % 16 == 0:
            ups.append((inter // count,) * count)
    hidden = max(int(t.arg("row0")) + int(t.arg("rows")) for t in down)
    rule_down = max(int(t.arg("rows")) for t in down)
    downs = [0] + [r for r in (rule_down // 2, rule_down // 4, rule_down * 2)
                   if r >= 16 and r % 16 == 0 and r <= hidden and r != rule_down]
    return list(dict.fromkeys(ups)), list(dict.fromkeys(downs))


def _megakernel_row(spec: ModelSpec, weights: dict[str, torch.Tensor], batch: int, context: int, *, sms: int,
                    bw: float, reps: int, page_size: int, profile_dir: Path | None, log,
                    attention_sms: int | None = None, ceilings: Ceilings = H200, predict: bool = True,
                    **lowering) -> Row:
    """Time the megakernel at one point (random KV cache, every sequence at position context - 1;
    the same tokens for a batch size every time); its buffers are freed on return. ``ceilings``:
    the scheduler's (the planner applies a tuned raise only under the default); ``lowering``: plan's
    LOWERING_CHOICES (default: the planner's); ``predict``: the row's predicted_us (about a second
    of simulation, which a tune's many timings skip)."""
    from mkc.codegen import build_kernel
    from mkc.schedule.plan import plan

    tokens = bench_tokens(spec, batch)
    positions = torch.full((batch,), context - 1, dtype=torch.int32)
    sc = plan(spec, batch, context, sms, page_size=page_size, attention_sms=attention_sms, ceilings=ceilings,
              **lowering)
    art = build_kernel(sc, spec)
    with decoder_in_place(sc, spec, weights, artifact=art) as dec:
        return _time_decoder(dec, sc, spec, tokens, positions, bw=bw, reps=reps, profile_dir=profile_dir, log=log,
                             predict=predict)


def _time_decoder(dec, sc, spec: ModelSpec, tokens, positions, *, bw: float, reps: int, profile_dir: Path | None,
                  log, predict: bool = True) -> Row:
    """Time a decoder built at one point (random KV cache, every sequence at position context - 1);
    its owner (decoder_in_place) closes it."""
    batch, context = sc.batch, sc.context
    fill_bench_kv(dec, spec)
    dec.step(tokens, positions)
    times = time_cuda(dec.launch, reps=reps, warmup=2)
    dec.check()
    routed = [dec.buffers[f"L{i}.moe_selected"].clone()
              for i, ls in enumerate(spec.layers) if ls.mlp == "moe"]
    art = dec.artifact
    att = sc.meta.get("attention_sms", {})
    lc = dec.launch_config  # the loaded kernel's resources, as the driver reports them
    log(f"batch {batch}: kernel {art.name}: {lc.regs} registers/thread, {lc.dynamic_smem} B dynamic + "
        f"{lc.static_smem} B static shared memory per CTA, {lc.threads} threads, "
        f"grid {lc.grid}; attention SMs {att.get('chosen', 0)} ({att.get('chosen_by', '-')}"
        + (f" at context {att['measured_at_context']}" if "measured_at_context" in att else "") + ")")
    if profile_dir is not None:
        _write_profile(dec, sc, spec, Path(profile_dir) / f"trace-b{batch}-c{context}.json")
    r = row("mkc", batch, context, times, step_bytes(spec, batch, context, routed), bw)
    if not predict:
        return r
    r.predicted_us = round(predicted_step_us(sc, bw), 1)
    log(f"batch {batch} context {context}: mkc compile's simulated step at this run's {bw / 1e12:.2f} TB/s: "
        f"{r.predicted_us:.1f} µs, {r.predicted_us / r.step_us - 1:+.1%} against the measured {r.step_us:.1f} µs")
    return r


def _baseline_row(spec: ModelSpec, weights: dict[str, torch.Tensor], batch: int, context: int, *, bw: float,
                  reps: int) -> Row:
    """Time the CUDA-graph PyTorch baseline at one point; its cache and graph are freed on return."""
    replay, base = graph_baseline(spec, weights, batch, context)
    times = time_cuda(replay, reps=reps, warmup=2)
    routed = [r.clone() for r in base.routed]
    return row("torch+graph", batch, context, times, step_bytes(spec, batch, context, routed), bw)


def _write_profile(dec, sc, spec: ModelSpec, path: Path) -> None:
    """Profile one real step and write it (write_profile)."""
    dec.launch(profile=True)
    dec.check()
    write_profile(sc, dec.timeline(), path)


def write_profile(sc, tl: dict, path: Path) -> None:
    """A step's per-task timeline as a Perfetto trace (same layout as mkc compile's trace.json, whose
    predicted step is written beside it as ``*.predicted.json``), with the critical chain on a track
    of its own and the read rate over the step (profile.read_rate, 1 µs bins) as a counter track;
    ``*.txt``: the per-op share of SM time, the critical chain, each stage's last task, the
    hand-offs between the stages that share an SM, and the middle layer's phases, read rate and
    chain tasks (profile.py); and ``*.npz``: the timeline itself by task id (op, layer,
    wait, start, end, sm), which benchmarks/replay_profile.py replays."""
    from mkc.schedule import visualize
    from mkc.schedule.profile import critical_chain, format_layer, format_profile, read_rate, save_timeline
    from mkc.schedule.simulate import predict

    events = []
    for sm in range(len(sc.queues)):
        events.append({"ph": "M", "name": "thread_name", "pid": 1, "tid": sm, "args": {"name": f"SM {sm}"}})
    for t in sc.tasks:
        i = t.id
        if tl["start"][i] > tl["wait"][i]:
            events.append({"ph": "X", "name": "wait", "cat": "wait", "pid": 1, "tid": int(tl["sm"][i]),
                           "ts": float(tl["wait"][i]), "dur": float(tl["start"][i] - tl["wait"][i])})
        events.append({"ph": "X", "name": t.name, "cat": t.op.name, "pid": 1, "tid": int(tl["sm"][i]),
                       "ts": float(tl["start"][i]), "dur": max(0.001, float(tl["end"][i] - tl["start"][i])),
                       "args": {"layer": t.layer, "bytes": t.weight_bytes + t.act_bytes}})
    chain_tid = len(sc.queues)
    events.append({"ph": "M", "name": "thread_name", "pid": 1, "tid": chain_tid, "args": {"name": "critical chain"}})
    for i in critical_chain(sc, tl["start"], tl["end"]).tasks:
        t = sc.tasks[i]
        events.append({"ph": "X", "name": t.name, "cat": t.op.name, "pid": 1, "tid": chain_tid,
                       "ts": float(tl["start"][i]), "dur": max(0.001, float(tl["end"][i] - tl["start"][i])),
                       "args": {"sm": int(tl["sm"][i])}})
    for ts, rate in zip(*read_rate(sc, tl["start"], tl["end"])):
        events.append({"ph": "C", "name": "read rate (TB/s)", "pid": 1, "ts": float(ts), "args": {"TB/s": round(float(rate), 3)}})
    events.insert(0, {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "measured step"}})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ns"}))
    # the predicted step beside it: the shared-bandwidth simulation's timeline (as mkc compile's) on
    # this GPU's read bandwidth (an H200's where none is here: a profile written from a saved timeline)
    gpu = gpu_name(torch.cuda.get_device_name(0)) if torch.cuda.is_available() else "h200"
    visualize.write_trace(predict(dataclasses.replace(sc, predicted=dict(sc.predicted)), gpu),
                          path.with_suffix(".predicted.json"))
    layers = sorted({t.layer for t in sc.tasks if t.layer >= 0})
    middle = f"\n\n{format_layer(sc, tl, layers[len(layers) // 2])}" if layers else ""
    path.with_suffix(".txt").write_text(format_profile(sc, tl) + middle + "\n")
    save_timeline(sc, tl, path.with_suffix(".npz"))


def bench_main(a) -> int:
    from mkc.ir.spec import load_spec
    from mkc.runtime.cuda_backend import cuda_available

    spec = load_spec(a.config)
    batches, contexts = a.batch, a.context
    if a.page_size > min(contexts):
        print(f"mkc: error: --page-size {a.page_size} is longer than the context {min(contexts)}: expected a page "
              f"of at most the shortest context", file=sys.stderr)
        return 2
    if not cuda_available():
        print("mkc: error: bench needs a CUDA GPU and none is usable here: expected an H100/H200 (sm_90a)",
              file=sys.stderr)
        return 2
    weights_bytes, free = memory_estimate(spec, 1, min(contexts)).weights, free_memory()
    if weights_bytes + MEMORY_MARGIN > free:
        print(f"mkc: error: the weights of {spec.name} ({weights_bytes / 1e9:.1f} GB in bf16) do not fit in the "
              f"{free / 1e9:.1f} GB free on {torch.cuda.get_device_name(0)}", file=sys.stderr)
        return 2
    if a.checkpoint:
        from mkc.runtime.weights import load_checkpoint

        weights = {k: v.cuda() for k, v in load_checkpoint(a.checkpoint, spec, torch.bfloat16).items()}
    else:
        weights = device_random_weights(spec, a.seed)
    out = Path(a.output)
    out.mkdir(parents=True, exist_ok=True)
    rows = run_bench(spec, weights, batches, contexts, reps=a.reps, profile_dir=out if a.profile else None,
                     page_size=a.page_size, tune=a.tune, tune_rounds=a.tune_rounds, tune_tiles=a.tune_tiles,
                     tune_every_count=a.tune_every_count)
    print(format_table(rows))
    write_json(rows, out / "bench.json", {"gpu": torch.cuda.get_device_name(0), "model": spec.name,
                                          "reps": a.reps, "weights": "checkpoint" if a.checkpoint else "random",
                                          "page_size": a.page_size})
    print(f"wrote {out / 'bench.json'}")
    return 0
