"""Prefill throughput on a GPU: the tensor-core prefill (FastPrefill) beside the float32
reference (Prefill) in the same run, over the weights as the CUDA backend holds them (tile order,
each layer's matrices reordered per chunk) and, for comparison, row-major.

    python benchmarks/prefill_speed.py --config configs/north_mini_code.yaml --prompts 1024,8192,32768 \
        --reference-prompts 1024,4096 --chunks 2048,8192 -o build/prefill.json

A prompt is prefilled in calls of ``--chunks`` tokens (the engine's ``--prefill-chunk``): each call
reads every layer's weights back from tile order once. Within a call, a layer runs ``--sub-chunks``
positions at a time (FastPrefill's ``chunk``: it bounds the activations; the first is the
default's, the others are timed in calls of the largest chunk).

Random bf16 weights made on the GPU; one slot's slab cache of the longest prompt. Each
tensor-core point is timed once after an untimed run of the same point (a first run pays the
libraries' set-up for its shapes, which the server does at start; prefill of a long prompt is
seconds, not microseconds: one run is the measurement); the float32 reference once. Writes JSON
with every point.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import time
from pathlib import Path

import torch

from mkc.codegen.weight_tiles import to_tiles
from mkc.ir.spec import load_spec
from mkc.runtime.bench import device_random_weights
from mkc.runtime.cuda_backend import LogicalWeights
from mkc.runtime.prefill import FastPrefill, Prefill, SlabKV, run_to_end

# FastPrefill's default positions at a time, read from its signature: BASE runs import older trees
SUB_CHUNK = inspect.signature(FastPrefill.__init__).parameters["chunk"].default


def _ints(v: str) -> list[int]:
    return [int(x) for x in v.split(",") if x]


def _time(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def _device_ms(events) -> float:
    """GPU time of a profile's ``key_averages()``: its device rows only, as torch's own table footer
    sums it. An aten row's self device time is the same kernels again, and a user annotation's
    device row spans them."""
    from torch.autograd import DeviceType

    return sum(e.self_device_time_total for e in events
               if e.device_type != DeviceType.CPU and not e.is_user_annotation) / 1e3


def stream_use(trace: dict, gaps: int = 10) -> dict:
    """From a chrome trace (torch.profiler's export): per CUDA stream, the time its kernels and
    copies keep it busy (their union), beside the span from the first GPU activity to the last;
    the time no stream is busy; and the stream busiest's ``gaps`` longest idle gaps, each with the
    kernels either side (where a prefill waits on the host or on the other stream)."""
    work = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"
            and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not work:
        return {}

    def union(evs):  # busy time, and each hole as (length, the event ending before, the one after)
        busy, end, last, holes = 0.0, None, None, []
        for e in sorted(evs, key=lambda e: e["ts"]):
            lo, hi = e["ts"], e["ts"] + e["dur"]
            if end is not None and lo > end:
                holes.append((lo - end, last, e))
            if end is None or hi > end:
                busy += hi - max(lo, end if end is not None else lo)
                end, last = hi, e
        return busy, holes

    span = max(e["ts"] + e["dur"] for e in work) - min(e["ts"] for e in work)
    by_stream: dict = {}
    for e in work:
        by_stream.setdefault(e.get("args", {}).get("stream", -1), []).append(e)
    streams = []
    for sid, evs in by_stream.items():
        busy, holes = union(evs)
        streams.append({"stream": sid, "busy_ms": round(busy / 1e3, 2), "ops": len(evs), "holes": holes})
    streams.sort(key=lambda r: -r["busy_ms"])
    main_holes = sorted(streams[0].pop("holes"), key=lambda h: -h[0])[:gaps]
    for r in streams[1:]:
        r.pop("holes")
    any_busy, _ = union(work)
    return {"span_ms": round(span / 1e3, 2), "idle_ms": round((span - any_busy) / 1e3, 2), "streams": streams,
            "longest_gaps": [{"us": round(g, 1), "after": a["name"][:80], "before": b["name"][:80]}
                             for g, a, b in main_holes]}


def _profile(run, ids: list[int], chunk: int, path: Path) -> None:
    """One prompt under torch.profiler (after an untimed run): each operator's GPU time, largest
    first; how busy each stream was (stream_use); the trace itself, gzipped beside ``path``."""
    import gzip
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    run(ids)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run(ids)
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        prof.export_chrome_trace(f"{tmp}/trace.json")
        text = Path(f"{tmp}/trace.json").read_text()
    path.with_suffix(".trace.json.gz").write_bytes(gzip.compress(text.encode()))
    use = stream_use(json.loads(text))
    events = prof.key_averages()
    # per operator: the kernels each aten op launched itself (its self device time), each kernel once
    ops = sorted((e for e in events if e.device_time_total > 0 and e.key.startswith("aten::")),
                 key=lambda e: -e.self_device_time_total)
    rows = [{"op": e.key, "gpu_ms": round(e.self_device_time_total / 1e3, 2), "calls": e.count} for e in ops[:25]]
    total = _device_ms(events)
    print(f"profile: a prompt of {len(ids)} in calls of {chunk}, {total:.1f} ms of GPU time")
    for r in rows:
        print(f"  {r['op']:<45} {r['gpu_ms']:>9.2f} ms  {r['calls']:>6} calls")
    if use:
        print(f"GPU span {use['span_ms']} ms, no stream busy {use['idle_ms']} ms; "
              + ", ".join(f"stream {r['stream']} busy {r['busy_ms']} ms ({r['ops']} ops)" for r in use["streams"]))
        for g in use["longest_gaps"]:
            print(f"  gap {g['us']:>8.1f} us after {g['after']} before {g['before']}")
    path.write_text(json.dumps({"gpu": torch.cuda.get_device_name(0), "prompt": len(ids), "chunk": chunk,
                                "gpu_ms": round(total, 1), "ops": rows, "stream_use": use}, indent=1))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/north_mini_code.yaml")
    p.add_argument("--prompts", type=_ints, default=[1024, 8192, 32768], help="prompt lengths (tokens)")
    p.add_argument("--reference-prompts", type=_ints, default=[1024, 4096],
                   help="prompt lengths for the float32 reference (slow: keep them short)")
    p.add_argument("--chunks", type=_ints, default=[2048, 8192],
                   help="prompt tokens per prefill call (the engine's --prefill-chunk) to time")
    p.add_argument("--sub-chunks", type=_ints, default=[SUB_CHUNK],
                   help="positions a layer runs at a time within a call (FastPrefill's chunk); the first "
                        "is timed at every point, the others at the prompts in calls of the largest chunk")
    p.add_argument("--row-major", action="store_true", help="also time over row-major weights (no reorder)")
    p.add_argument("--profile", type=int, default=0, metavar="TOKENS",
                   help="also profile one prompt of TOKENS over tile order in calls of the largest chunk: "
                        "the GPU time per operator, printed and written beside the output (*-profile.json)")
    p.add_argument("-o", "--output", default="build/prefill.json")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("mkc: error: prefill_speed.py needs a CUDA GPU", file=sys.stderr)
        return 2
    spec = load_spec(a.config)
    att = spec.attention
    weights = device_random_weights(spec, 0)
    ctx = max(a.prompts + a.reference_prompts)
    cache = SlabKV([tuple(torch.zeros(att.num_kv_heads, ctx, att.head_dim, dtype=torch.bfloat16, device="cuda")
                          for _ in range(2)) for _ in range(spec.num_layers)])  # type: ignore[misc]
    gen = torch.Generator().manual_seed(0)
    rows: list[dict] = []

    def point(kind: str, layout: str, chunk: int, n: int, run, warm: bool = True, sub_chunk: int | None = None) -> None:
        ids = torch.randint(0, spec.vocab_size, (n,), generator=gen).tolist()
        if warm:
            run(ids)
        torch.cuda.reset_peak_memory_stats()
        seconds = _time(lambda: run(ids))
        row = {"prefill": kind, "weights": layout, "chunk": chunk, "sub_chunk": sub_chunk, "prompt": n,
               "seconds": round(seconds, 4), "tok_per_s": round(n / seconds, 1),
               "peak_gb": round(torch.cuda.max_memory_allocated() / 1e9, 2)}
        rows.append(row)
        print(json.dumps(row), flush=True)

    def calls(fast: FastPrefill, chunk: int):
        def run(ids):
            for lo in range(0, len(ids), chunk):
                run_to_end(fast.layers(ids[lo:lo + chunk], lo, cache, logits=lo + chunk >= len(ids)))
        return run

    def fast_points(w, layout: str) -> None:
        fast = FastPrefill(spec, w, chunk=a.sub_chunks[0])
        for chunk in a.chunks:
            for n in a.prompts:
                point("fast", layout, chunk, n, calls(fast, chunk), sub_chunk=fast.chunk)
        for sub in a.sub_chunks[1:]:
            for n in a.prompts:
                point("fast", layout, max(a.chunks), n, calls(FastPrefill(spec, w, chunk=sub), max(a.chunks)),
                      sub_chunk=sub)

    if a.row_major:
        fast_points(weights, "row-major")
    # the CUDA backend's layout: every GEMV weight in tile order, read back a layer at a time
    tiled = [n for n, t in weights.items() if t.dim() >= 2 and n != "embed" or (n == "embed" and
                                                                              spec.tie_word_embeddings)]
    tiled = [n for n in tiled if weights[n].shape[-2] % 16 == 0 and weights[n].shape[-1] % 64 == 0]
    for n in tiled:
        weights[n].copy_(to_tiles(weights[n]))
    lw = LogicalWeights(weights, list(weights), frozenset(tiled))
    fast_points(lw, "tiles")
    ref = Prefill(spec, lw, act_dtype=torch.bfloat16)  # type: ignore[arg-type]
    for n in a.reference_prompts:
        point("reference", "tiles", ref.chunk, n, lambda ids: ref.run(ids, 0, cache), warm=False)
    out = Path(a.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    if a.profile:
        _profile(calls(FastPrefill(spec, lw), max(a.chunks)), list(range(a.profile)), max(a.chunks),
                 out.with_name(out.stem + "-profile.json"))
    out.write_text(json.dumps({"gpu": torch.cuda.get_device_name(0), "model": spec.name, "rows": rows}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
