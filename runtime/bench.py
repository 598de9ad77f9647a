"""``mkc bench``: decode step time of the megakernel beside a CUDA-graph PyTorch baseline.

Speed-of-light (docs/design.md): the bytes one step must read — active weights with the *distinct*
experts actually routed in that step, plus the KV cache actually attended (global layers: the
whole context; sliding layers: min(context, window)) — over the read bandwidth measured in the
same run. SOL fraction = SOL time / measured step time.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import statistics
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from mkc.ir.kv_layout import pages_per_seq
from mkc.ir.spec import ModelSpec
from mkc.schedule.cost import H200, Ceilings, gpu_name
from mkc.schedule.schedule import Schedule
from mkc.schedule.tune import in_turn  # noqa: F401 (the benchmarks take it from here)

BF16 = 2


def step_bytes(spec: ModelSpec, batch: int, context: int, routed: list[torch.Tensor], weights: str = "bf16") -> int:
    """Bytes one decode step must read at ``context`` tokens per sequence (position context - 1).

    ``routed`` holds the [batch, top_k] expert ids of each MoE layer, in layer order; ``weights``
    the format of the matrices a GEMV streams (mkc/ir/fp8.py: FP8 ones count a byte per element
    and their scales; embeddings, norms and routers stay bf16).
    """
    from mkc.ir.fp8 import is_fp8, scale_bytes

    a, H = spec.attention, spec.hidden_size

    def matrix(rows: int, k: int) -> int:
        return rows * k + scale_bytes(weights, rows, k) if is_fp8(weights) else rows * k * BF16

    total = batch * H * BF16  # embedding rows
    moe_layers = iter(routed)
    for ls in spec.layers:
        total += H * BF16  # norm
        total += matrix((a.num_heads + 2 * a.num_kv_heads) * a.head_dim, H) + matrix(H, a.num_heads * a.head_dim)
        if a.qk_norm:
            total += 2 * a.head_dim * BF16
        if spec.block == "sequential":
            total += H * BF16
        keys = min(context, a.sliding_window) if ls.attention == "sliding" else context
        total += batch * keys * a.num_kv_heads * a.head_dim * 2 * BF16  # K and V attended
        if ls.mlp == "dense":
            total += matrix(2 * spec.dense_intermediate, H) + matrix(H, spec.dense_intermediate)
        else:
            m = spec.moe
            assert m is not None
            distinct = int(torch.unique(next(moe_layers)).numel())
            total += m.num_experts * H * BF16  # router
            total += distinct * (matrix(2 * m.intermediate, H) + matrix(H, m.intermediate))
    total += H * BF16 + matrix(spec.vocab_size, H)  # final norm, LM head
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


def memory_estimate(spec: ModelSpec, batch: int, context: int, page_size: int = 0,
                    weights_format: str = "bf16") -> MemoryEstimate:
    """What ``mkc bench`` needs on the GPU at ``batch`` sequences of ``context`` positions.

    KV cache: K and V of every layer, ``kv_heads x head_dim`` bf16 per position, for the whole
    context bucket (sliding layers too). A paged cache (``page_size`` > 0) holds every page of every
    sequence (the identity page table), so it is never smaller than the contiguous one; it is larger
    by the last page's rounding and the page table. The baseline's attention scratch is the worst
    case of torch's SDPA, its math fallback (a boolean mask with grouped KV heads rules out flash
    attention): K and V of one layer widened to fp32, repeated per query head, and K scaled once more.
    """
    from mkc.ir.fp8 import stored_bytes
    from mkc.runtime.weights import weight_shapes

    a = spec.attention
    position = 2 * spec.num_layers * a.num_kv_heads * a.head_dim * BF16  # K and V, all layers
    if page_size:
        pages = batch * pages_per_seq(context, page_size)
        kv = pages * page_size * position + pages * 4  # the pool; the page table (int32)
    else:
        kv = batch * context * position
    scratch = batch * context * a.head_dim * 4 * (2 * a.num_kv_heads + 3 * a.num_heads)
    weights = stored_bytes(weight_shapes(spec), weights_format, spec.tie_word_embeddings)
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
    return dict(_device_random(spec, seed, device))


def _device_random(spec: ModelSpec, seed: int, device: str = "cuda") -> Iterator[tuple[str, torch.Tensor]]:
    from mkc.runtime.weights import weight_shapes

    g = torch.Generator(device=device).manual_seed(seed)
    for name, shape in weight_shapes(spec).items():
        x = torch.randn(shape, device=device, dtype=torch.bfloat16, generator=g)
        yield name, (x.mul_(0.05).add_(1.0) if name.endswith("norm") else x.mul_(0.02))


def device_random_fp8_weights(spec: ModelSpec, seed: int, fmt: str, device: str = "cuda") -> dict[str, torch.Tensor]:
    """device_random_weights' values (the same seed gives the same bf16 matrices), each FP8 matrix
    of ``buffers`` quantised as soon as it is made (runtime/quantize.py: fp8_device_weights), so the
    GPU never holds the bf16 model: North Mini Code's 31 GB in FP8 on an 80 GB H100."""
    from mkc.codegen.weight_tiles import TiledWeights
    from mkc.ir.fp8 import SCALE_SUFFIX, fp8_matrices
    from mkc.runtime.quantize import fp8_device_matrix
    from mkc.runtime.weights import weight_shapes

    fp8_names = fp8_matrices(weight_shapes(spec), spec.tie_word_embeddings)
    out: dict[str, torch.Tensor] = {}
    for name, x in _device_random(spec, seed, device):
        if name in fp8_names:
            out[name], out[name + SCALE_SUFFIX] = fp8_device_matrix(x, fmt, name)
            del x
        else:
            out[name] = x
    if "lm_head" in fp8_names and "lm_head" not in out:  # a tied embedding's FP8 copy
        out["lm_head"], out["lm_head" + SCALE_SUFFIX] = fp8_device_matrix(out["embed"], fmt, "lm_head")
    return TiledWeights(out, fp8_names)


def fill_random_kv(dec, spec: ModelSpec, generator: torch.Generator | None = None) -> None:
    """Every layer's KV cache of a decoder filled with normal(0, 1) values: the cache a benchmarked
    step attends to (``generator``: the same cache for every decoder of a comparison)."""
    for layer in range(spec.num_layers):
        for t in dec.kv_cache(layer):
            t.normal_(generator=generator)


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
    names = [n for n in tiled_weights(sc) if sc.buffers[n].dtype == "bf16"] if art.config.weights_tiled else ()
    with tile_ordered_in_place(weights, names) as tw:
        dec = CudaDecoder(sc, spec, tw, artifact=art)
        try:
            yield dec
        finally:
            dec.close()  # lets go of its buffers: the caller's name for it outlives the block
            torch.cuda.empty_cache()


def mkc_engine(weights: str) -> str:
    """The engine name of the megakernel's rows with weight format ``weights``: "mkc", "mkc fp8"."""
    return "mkc" if weights == "bf16" else f"mkc {weights}"


def time_step(dec, spec: ModelSpec, batch: int, context: int, bw: float, reps: int) -> tuple[float, float, list[float]]:
    """Time ``reps`` launches of a decoder whose inputs are in place (after 2 warm-ups): the median
    step (s), its speed-of-light fraction (the distinct experts it routed, read bandwidth ``bw``)
    and every time."""
    times = time_cuda(dec.launch, reps=reps, warmup=2)
    dec.check()
    routed = [dec.buffers[f"L{i}.moe_selected"] for i, ls in enumerate(spec.layers) if ls.mlp == "moe"]
    med = statistics.median(times)
    fmt = dec.schedule.meta.get("weights", "bf16")
    return med, step_bytes(spec, batch, context, routed, fmt) / bw / med, times


def run_bench(spec: ModelSpec, weights: dict[str, torch.Tensor], batches: list[int], contexts: list[int], *,
              reps: int = 20, profile_dir: Path | None = None, page_size: int = 0, tune: bool = False,
              tune_rounds: int = 1, tune_tiles: bool = False, tune_every_count: bool = False,
              weights_format: str = "bf16", log=print) -> list[Row | Skip]:
    """Megakernel and CUDA-graph PyTorch baseline, side by side, per (batch, context); the
    megakernel's KV cache paged when ``page_size`` > 0 (under the identity page table). With
    ``tune``, each point first times every attention-SM count (tune_attention_sms); the fastest
    count's run is the megakernel row (with ``profile_dir``, that count runs again, profiled);
    ``tune_rounds``, ``tune_tiles``, ``tune_every_count``: as tune_attention_sms's ``rounds``,
    ``tiles`` and ``every_count``.

    Before each engine allocates anything its memory estimate (memory_estimate) is compared with
    the GPU's free memory: an engine that does not fit is skipped with a Skip saying what it needed
    and what was free (as is one that runs out of memory anyway), and the other points still run.
    ``weights_format``: the megakernel's (``weights`` laid out for it: bench_main); the baseline runs
    with bf16 weights only, so it is left out of FP8 runs."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    bw = measure_read_bandwidth()
    log(f"read bandwidth {bw / 1e12:.2f} TB/s (torch sum over 4 GiB, this run)")
    out: list[Row | Skip] = []
    for batch in batches:
        for context in contexts:
            est = memory_estimate(spec, batch, context, page_size, weights_format)
            contiguous = memory_estimate(spec, batch, context) if page_size else None
            for engine in ("mkc", "torch+graph") if weights_format == "bf16" else ("mkc",):
                free = free_memory()
                why = memory_skip(est, engine, free, contiguous)
                need = est.megakernel if engine == "mkc" else est.baseline
                if why is None:
                    try:
                        if engine == "mkc":
                            tuned = _tune(spec, weights, batch, context, sms=sms, bw=bw, reps=reps,
                                          page_size=page_size, log=log, rounds=tune_rounds,
                                          tiles=tune_tiles, every_count=tune_every_count,
                                          weights_format=weights_format) if tune else None
                            if tuned and profile_dir is None:  # the fastest count's run is the row
                                for line in tuned[2]:
                                    log(line)
                                out.append(tuned[1])
                            else:
                                out.append(_megakernel_row(spec, weights, batch, context, sms=sms, bw=bw,
                                                           reps=reps, page_size=page_size,
                                                           profile_dir=profile_dir, log=log,
                                                           weights=weights_format))
                        else:
                            out.append(_baseline_row(spec, weights, batch, context, bw=bw, reps=reps))
                        continue
                    except torch.cuda.OutOfMemoryError as e:
                        why = (f"{engine} ran out of device memory although its estimate "
                               f"({need / 1e9:.1f} GB) fit in {free / 1e9:.1f} GB free: {str(e).splitlines()[0]}")
                    gc.collect()  # the failed engine's tensors, held by its traceback's frames
                    torch.cuda.empty_cache()
                out.append(Skip(mkc_engine(weights_format) if engine == "mkc" else engine, batch, context, need,
                                free, why))
                log(f"batch {batch} context {context}: skipped: {why}")
            m, b = out[-2], out[-1]
            if weights_format == "bf16" and isinstance(m, Row) and isinstance(b, Row):
                log(f"batch {batch} context {context}: mkc {m.step_us:.1f} µs ({m.sol_fraction:.1%} SOL), "
                    f"torch+graph {b.step_us:.1f} µs ({b.sol_fraction:.1%} SOL), speed-up {b.step_us / m.step_us:.2f}x")
    return out


def tune_attention_sms(spec: ModelSpec, weights: dict[str, torch.Tensor], batch: int, context: int, *, sms: int,
                       bw: float, reps: int, page_size: int = 0, log=print, rounds: int = 1,
                       tiles: bool = False, every_count: bool = False) -> int:
    """Tune the schedule at this point on this GPU (mkc/schedule/tune.py: run_tune, which says what
    it times and records) and return the attention-SM count it records (0 for a sequential block,
    whose other choices it times). Every schedule runs the same tokens and KV cache."""
    best = _tune(spec, weights, batch, context, sms=sms, bw=bw, reps=reps, page_size=page_size, log=log,
                 rounds=rounds, tiles=tiles, every_count=every_count)
    return best[0]


def _tune(spec: ModelSpec, weights: dict[str, torch.Tensor], batch: int, context: int, *, sms: int, bw: float,
          reps: int, page_size: int, log, rounds: int = 1, tiles: bool = False,
          every_count: bool = False, weights_format: str = "bf16") -> tuple[int, Row, list[str]]:
    """tune_attention_sms, also returning the fastest count's row and the lines its run logged
    (so that mkc bench --tune reports that run instead of timing the count again). The search is
    mkc/schedule/tune.py's; this times each schedule it asks for."""
    from mkc.codegen import CodegenError
    from mkc.ir.spec import SpecError
    from mkc.schedule.tune import Candidate, run_tune

    runs: dict[Candidate, tuple[Row, list[str]]] = {}  # each schedule's latest run and what it logged

    def time(c: Candidate, what: str, schedule: Callable[[], Schedule]) -> float:
        lines: list[str] = []
        r = _megakernel_row(spec, weights, batch, context, sms=sms, bw=bw, reps=reps, page_size=page_size,
                            profile_dir=None, log=lines.append, attention_sms=c.attention_sms, predict=False,
                            ceilings=c.ceilings(), schedule=schedule, **c.lowering())
        runs[c] = (r, lines)
        log(f"batch {batch} context {context}: {what}: {r.step_us:.1f} µs ({r.sol_fraction:.1%} SOL)")
        return r.step_us

    chosen = run_tune(spec, batch, context, sms, page_size, time=time, log=log, rounds=rounds, reps=reps,
                      gpu=lambda: torch.cuda.get_device_name(0), tiles=tiles, every_count=every_count,
                      build_errors=(CodegenError, SpecError), weights=weights_format)
    return chosen.attention_sms, *runs[chosen]


def _megakernel_row(spec: ModelSpec, tensors: dict[str, torch.Tensor], batch: int, context: int, *, sms: int,
                    bw: float, reps: int, page_size: int, profile_dir: Path | None, log,
                    attention_sms: int | None = None, ceilings: Ceilings = H200, predict: bool = True,
                    schedule: Callable[[], Schedule] | None = None, **lowering) -> Row:
    """Time the megakernel at one point (random KV cache, every sequence at position context - 1;
    the same tokens for a batch size every time); its buffers are freed on return. ``ceilings``:
    the scheduler's (the planner applies a tuned raise only under the default); ``lowering``: plan's
    LOWERING_CHOICES (default: the planner's); ``predict``: the row's predicted_us (about a second
    of simulation, which a tune's many timings skip); ``schedule``: gives the schedule these
    arguments plan (a tune's, planned once for all its timings); ``tensors``: the weights
    laid out for it (``weights`` among ``lowering`` is their format)."""
    from mkc.codegen import build_kernel
    from mkc.schedule.plan import plan

    tokens = bench_tokens(spec, batch)
    positions = torch.full((batch,), context - 1, dtype=torch.int32)
    sc = schedule() if schedule else plan(spec, batch, context, sms, page_size=page_size,
                                          attention_sms=attention_sms, ceilings=ceilings, **lowering)
    art = build_kernel(sc, spec)
    with decoder_in_place(sc, spec, tensors, artifact=art) as dec:
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
    fmt = sc.meta.get("weights", "bf16")
    if profile_dir is not None:
        _write_profile(dec, sc, spec, Path(profile_dir) / trace_name(batch, context, fmt))
    r = row(mkc_engine(fmt), batch, context, times, step_bytes(spec, batch, context, routed, fmt), bw)
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


def trace_name(batch: int, context: int, weights: str = "bf16") -> str:
    """The profile trace's file name at a point: ``trace-b1-c8192.json``, the weight format added
    when not bf16 (``trace-b1-c8192-fp8.json``), so that one run over several formats keeps each."""
    return f"trace-b{batch}-c{context}{'' if weights == 'bf16' else '-' + weights}.json"


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
    formats = getattr(a, "weights", None) or ["bf16"]
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
    out = Path(a.output)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[Row | Skip] = []
    for fmt in formats:  # each format on freshly made weights, the last format's freed first
        weights = bench_weights(spec, a, fmt)
        rows += run_bench(spec, weights, batches, contexts, reps=a.reps, profile_dir=out if a.profile else None,
                          page_size=a.page_size, tune=a.tune, tune_rounds=a.tune_rounds, tune_tiles=a.tune_tiles,
                          tune_every_count=a.tune_every_count, weights_format=fmt)
        del weights
        gc.collect()
        torch.cuda.empty_cache()
    print(format_table(rows))
    write_json(rows, out / "bench.json", {"gpu": torch.cuda.get_device_name(0), "model": spec.name,
                                          "reps": a.reps, "weights": "checkpoint" if a.checkpoint else "random",
                                          "page_size": a.page_size, "weight_formats": formats})
    print(f"wrote {out / 'bench.json'}")
    return 0


def bench_weights(spec: ModelSpec, a, fmt: str) -> dict[str, torch.Tensor]:
    """The weights ``mkc bench`` times format ``fmt`` with, on the GPU: the checkpoint's or random
    bf16 ones, the FP8 formats' matrices quantised from them and laid out for the kernel (random:
    device_random_fp8_weights, each as it is made; a checkpoint's: fp8_device_weights)."""
    if a.checkpoint:
        from mkc.runtime.weights import load_checkpoint

        weights = {k: v.cuda() for k, v in load_checkpoint(a.checkpoint, spec, torch.bfloat16).items()}
        if fmt == "bf16":
            return weights
        from mkc.ir.fp8 import fp8_matrices
        from mkc.runtime.quantize import fp8_device_weights

        return fp8_device_weights(weights, fp8_matrices(weights, spec.tie_word_embeddings), fmt)
    if fmt == "bf16":
        return device_random_weights(spec, a.seed)
    return device_random_fp8_weights(spec, a.seed, fmt)
