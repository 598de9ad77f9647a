"""``mkc bench``: decode step time of the megakernel beside a CUDA-graph PyTorch baseline.

Speed-of-light (DESIGN.md): the bytes one step must read — active weights with the *distinct*
experts actually routed in that step, plus the KV cache actually attended (global layers: the
whole context; sliding layers: min(context, window)) — over the read bandwidth measured in the
same run. SOL fraction = SOL time / measured step time.
"""

from __future__ import annotations

import json
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from mkc.ir.spec import ModelSpec

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
    """Bytes/s of a torch sum over ``nbytes`` on the current GPU (DESIGN.md's ceiling)."""
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


def row(engine: str, batch: int, context: int, times: list[float], nbytes: int, bw: float) -> Row:
    t = statistics.median(times)
    return Row(engine, batch, context, t * 1e6, batch / t, nbytes, bw, (nbytes / bw) / t)


def format_table(rows: list[Row]) -> str:
    head = f"{'engine':<12} {'batch':>5} {'context':>8} {'step µs':>9} {'tok/s':>8} {'GB read':>8} {'SOL':>6}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r.engine:<12} {r.batch:>5} {r.context:>8} {r.step_us:>9.1f} {r.tok_s:>8.1f} "
                     f"{r.bytes / 1e9:>8.3f} {r.sol_fraction:>6.1%}")
    return "\n".join(lines)


def write_json(rows: list[Row], path: str | Path, meta: dict) -> None:
    Path(path).write_text(json.dumps({"meta": meta, "rows": [asdict(r) for r in rows]}, indent=1))


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


def _kv_bytes(spec: ModelSpec, batch: int, context: int) -> int:
    a = spec.attention
    return spec.num_layers * batch * a.num_kv_heads * context * a.head_dim * 2 * BF16


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
              reps: int = 20, profile_dir: Path | None = None, page_size: int = 0, log=print) -> list[Row]:
    """Megakernel and CUDA-graph PyTorch baseline, side by side, per (batch, context); the
    megakernel's KV cache paged when ``page_size`` > 0 (under the identity page table)."""
    from mkc.ir.lower import lower
    from mkc.runtime.cuda_backend import CudaDecoder
    from mkc.schedule.scheduler import schedule

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    bw = measure_read_bandwidth()
    log(f"read bandwidth {bw / 1e12:.2f} TB/s (torch sum over 4 GiB, this run)")
    rows: list[Row] = []
    for batch in batches:
        for context in contexts:
            free, _ = torch.cuda.mem_get_info()
            if 2.2 * _kv_bytes(spec, batch, context) > free:
                log(f"batch {batch} context {context}: skipped, two KV caches of "
                    f"{_kv_bytes(spec, batch, context) / 1e9:.1f} GB do not fit in {free / 1e9:.1f} GB free")
                continue
            tokens = torch.randint(0, spec.vocab_size, (batch,), dtype=torch.int32)
            positions = torch.full((batch,), context - 1, dtype=torch.int32)
            sc = schedule(lower(spec, batch, context, sms, page_size=page_size), spec.name)
            dec = CudaDecoder(sc, spec, weights)
            for layer in range(spec.num_layers):
                for t in dec.kv_cache(layer):
                    t.normal_()
            dec.step(tokens, positions)
            times = time_cuda(dec.launch, reps=reps, warmup=2)
            dec.check()
            routed = [dec.buffers[f"L{i}.moe_selected"]
                      for i, ls in enumerate(spec.layers) if ls.mlp == "moe"]
            nbytes = step_bytes(spec, batch, context, routed)
            rows.append(row("mkc", batch, context, times, nbytes, bw))
            art = dec.artifact
            log(f"batch {batch}: kernel {art.name}: {art.regs} registers/thread, {art.dynamic_smem} B dynamic + "
                f"{art.smem} B static shared memory per CTA, {dec.launch_config.threads} threads, "
                f"grid {dec.launch_config.grid}")
            if profile_dir is not None:
                _write_profile(dec, sc, spec, Path(profile_dir) / f"trace-b{batch}-c{context}.json")
            dec.close()
            del dec
            torch.cuda.empty_cache()
            replay, base = graph_baseline(spec, weights, batch, context)
            btimes = time_cuda(replay, reps=reps, warmup=2)
            routed = [r.clone() for r in base.routed]
            rows.append(row("torch+graph", batch, context, btimes, step_bytes(spec, batch, context, routed), bw))
            del replay, base
            torch.cuda.empty_cache()
            m, b = rows[-2], rows[-1]
            log(f"batch {batch} context {context}: mkc {m.step_us:.1f} µs ({m.sol_fraction:.1%} SOL), "
                f"torch+graph {b.step_us:.1f} µs ({b.sol_fraction:.1%} SOL), speed-up {b.step_us / m.step_us:.2f}x")
    return rows


def _write_profile(dec, sc, spec: ModelSpec, path: Path) -> None:
    """Profile one real step and write it (write_profile)."""
    dec.launch(profile=True)
    dec.check()
    write_profile(sc, dec.timeline(), path)


def write_profile(sc, tl: dict, path: Path) -> None:
    """A step's per-task timeline as a Perfetto trace (same layout as mkc compile's trace.json, whose
    predicted step is written beside it as ``*.predicted.json``), with the critical chain on a track
    of its own; and ``*.txt``: the per-op share of SM time and the critical chain (profile.py)."""
    from mkc.schedule import visualize
    from mkc.schedule.profile import critical_chain, format_profile

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
    events.insert(0, {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "measured step"}})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ns"}))
    visualize.write_trace(sc, path.with_suffix(".predicted.json"))
    path.with_suffix(".txt").write_text(format_profile(sc, tl) + "\n")


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
    if a.checkpoint:
        from mkc.runtime.weights import load_checkpoint

        weights = {k: v.cuda() for k, v in load_checkpoint(a.checkpoint, spec, torch.bfloat16).items()}
    else:
        weights = device_random_weights(spec, a.seed)
    out = Path(a.output)
    out.mkdir(parents=True, exist_ok=True)
    rows = run_bench(spec, weights, batches, contexts, reps=a.reps, profile_dir=out if a.profile else None,
                     page_size=a.page_size)
    print(format_table(rows))
    write_json(rows, out / "bench.json", {"gpu": torch.cuda.get_device_name(0), "model": spec.name,
                                          "reps": a.reps, "weights": "checkpoint" if a.checkpoint else "random",
                                          "page_size": a.page_size})
    print(f"wrote {out / 'bench.json'}")
    return 0
