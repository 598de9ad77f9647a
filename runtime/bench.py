"""``mkc bench``: decode step time of the megakernel beside a CUDA-graph PyTorch baseline.

Speed-of-light (DESIGN.md): the bytes one step must read — active weights with the *distinct*
experts actually routed in that step, plus the KV cache actually attended (global layers: the
whole context; sliding layers: min(context, window)) — over the read bandwidth measured in the
same run. SOL fraction = SOL time / measured step time.
"""

from __future__ import annotations

import json
import statistics
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
    del x
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
