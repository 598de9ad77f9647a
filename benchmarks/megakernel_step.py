"""Decode-step time of the megakernel on North Mini Code (random bf16 weights made on the GPU).

    python benchmarks/megakernel_step.py --batch 1 8 --context 8192 [--reps 20] [--json out.json]

For each (batch, context): random KV cache, every sequence at the end of the bucket, one warm-up
step, then ``reps`` steps timed one by one with CUDA events around the kernel launch alone (the
inputs stay in their device buffers); the median is reported with the speed-of-light fraction
(bytes the step must read, with the distinct experts actually routed, over the read bandwidth
measured in the same run; runtime/bench.py). Timing lives here, never in test asserts.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from pathlib import Path

import profiled
import torch

from mkc.codegen import CodegenOptions
from mkc.ir.spec import load_spec
from mkc.runtime.bench import (
    bench_tokens,
    decoder_in_place,
    device_random_weights,
    fill_bench_kv,
    format_table,
    measure_read_bandwidth,
    row,
    step_bytes,
    time_cuda,
    write_json,
)
from mkc.runtime.cuda_backend import CudaDecoder
from mkc.schedule.plan import plan
from mkc.schedule.profile import (
    format_chain,
    format_handoffs,
    format_last_tasks,
    format_layer,
    format_layer_times,
    format_phases,
    format_stage_ends,
    save_timeline,
)

ROOT = Path(__file__).resolve().parents[1]


def profile_summary(dec: CudaDecoder, path: str) -> str:
    """One profiled step: where the SMs' time goes, per op (run = signalled - started, wait =
    started - began waiting), and the step's span; the per-task timeline is saved to ``path``."""
    import numpy as np

    dec.launch(profile=True)
    dec.check()
    tl = dec.timeline()
    tasks = dec.schedule.tasks
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    save_timeline(dec.schedule, tl, path)
    span = tl["end"].max()
    run, wait = tl["end"] - tl["start"], tl["start"] - tl["wait"]
    lines = [(f"profiled step: span {span:.1f} µs over {len(set(tl['sm'].tolist()))} SMs; SM time running "
             f"{run.sum() / (span * dec.schedule.num_sms):.1%}, waiting {wait.sum() / (span * dec.schedule.num_sms):.1%}"),
             f"{'op':<14} {'tasks':>6} {'run µs':>10} {'mean':>8} {'max':>8} {'wait µs':>10} {'GB/s/task':>10}"]
    ops = sorted({t.op for t in tasks}, key=lambda o: -sum(run[i] for i, t in enumerate(tasks) if t.op == o))
    for op in ops:
        idx = np.array([i for i, t in enumerate(tasks) if t.op == op])
        by = np.array([tasks[i].weight_bytes + tasks[i].act_bytes for i in idx], dtype=np.float64)
        bw = (by / np.maximum(run[idx], 1e-3)).mean() / 1e3
        lines.append(f"{op.name:<14} {len(idx):>6} {run[idx].sum():>10.0f} {run[idx].mean():>8.2f} "
                     f"{run[idx].max():>8.2f} {wait[idx].sum():>10.0f} {bw:>10.1f}")
    lines.append(format_chain(dec.schedule, tl["start"], tl["end"]))
    lines.append(format_layer_times(dec.schedule, tl))
    lines.append(format_stage_ends(dec.schedule, tl))
    lines.append(format_last_tasks(dec.schedule, tl))
    lines.append(format_handoffs(dec.schedule, tl))
    if "done" in tl:  # a kernel built with profile_phases
        lines.append(format_phases(dec.schedule, tl))
    per_layer = [tl["end"][[i for i, t in enumerate(tasks) if t.layer == L]].max() for L in range(-1, max(t.layer for t in tasks) + 1)]
    lines.append(format_layer(dec.schedule, tl, 10))
    lines.append("layer ends (µs): " + " ".join(f"{x:.0f}" for x in per_layer[:8]) + " ... " +
                 " ".join(f"{x:.0f}" for x in per_layer[-3:]))
    return "\n".join(lines)


def codegen_fields(pairs: list[str]) -> dict[str, int | bool | str]:
    """FIELD=VALUE pairs of CodegenOptions fields: integers, booleans as 0 / 1, strings as written
    (SystemExit names a bad one)."""
    known = {f.name: str(f.type) for f in dataclasses.fields(CodegenOptions)}
    out: dict[str, int | bool | str] = {}
    for p in pairs:
        name, _, value = p.partition("=")
        numeric = known.get(name) in ("int", "bool")
        if name not in known or (numeric and not value.lstrip("-").isdigit()):
            raise SystemExit(f"--options {p}: expected FIELD=VALUE (an integer for int and bool fields) with FIELD "
                             f"one of {', '.join(known)}")
        out[name] = value if not numeric else bool(int(value)) if known[name] == "bool" else int(value)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "north_mini_code.yaml"))
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--context", type=int, nargs="+", default=[8192])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", default=None)
    ap.add_argument("--profile", default=None, help="folder: per-task timeline (npz) and per-op summary")
    ap.add_argument("--attention-sms", type=int, default=None,
                    help="SMs set apart for the attention splits (default: the compiler's choice)")
    ap.add_argument("--rope-in-splits", nargs="+", default=["yes"], choices=["yes", "no"],
                    help="LowerOptions.rope_in_splits values to run (no: a ROPE_APPEND task rotates q first)")
    ap.add_argument("--warp-stages", type=int, nargs="+", default=[None],
                    help="CodegenOptions.attn_warp_stages values to run (0: CTA-wide attention chunks; "
                         "default: the default kernel)")
    ap.add_argument("--options", nargs="*", default=[], metavar="FIELD=VALUE",
                    help="CodegenOptions fields for every run, e.g. gemv_unroll=6 tagged_logits=off")
    ap.add_argument("--lowering", nargs="*", default=[], metavar="CHOICE=VALUE",
                    help="lowering choices for every run (plan's LOWERING_CHOICES; booleans as 0 / 1), e.g. "
                         "residual_in_o_proj=1 expert_down_rows=256")
    a = ap.parse_args()
    extra = codegen_fields(a.options)
    lowering = profiled.lowering_of(a)
    spec = load_spec(a.config)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    bw = measure_read_bandwidth()
    t0 = time.perf_counter()
    weights = device_random_weights(spec, 2026)
    torch.cuda.synchronize()
    print(f"read bandwidth {bw / 1e12:.2f} TB/s; weights {sum(w.numel() for w in weights.values()) * 2 / 1e9:.1f} GB "
          f"made in {time.perf_counter() - t0:.1f} s", flush=True)
    rows = []
    runs = ((b, c, r, w) for b in a.batch for c in a.context for r in a.rope_in_splits for w in a.warp_stages)
    for batch, context, rope, stages in runs:
        sc = plan(spec, batch, context, sms, attention_sms=a.attention_sms, **{"rope_in_splits": rope == "yes", **lowering})
        options = CodegenOptions(**extra) if stages is None else CodegenOptions(**extra, attn_warp_stages=stages)
        with decoder_in_place(sc, spec, weights, options=options) as dec:
            # the inputs mkc bench uses, so runs and trees compare on the same experts
            fill_bench_kv(dec, spec)
            tokens = bench_tokens(spec, batch)
            positions = torch.tensor([context - 1] * batch, dtype=torch.int32)
            dec.step(tokens, positions)
            times = time_cuda(dec.launch, reps=a.reps, warmup=2)
            dec.check()
            routed = [dec.buffers[f"L{i}.moe_selected"]
                      for i, ls in enumerate(spec.layers) if ls.mlp == "moe"]
            nbytes = step_bytes(spec, batch, context, routed)
            r = row("mkc", batch, context, times, nbytes, bw)
            rows.append(r)
            print(f"batch {batch} context {context} rope in splits {rope} warp stages "
                  f"{dec.artifact.config.attn_warp_stages}: median {r.step_us:.1f} µs (min {min(times) * 1e6:.1f}, "
                  f"max {max(times) * 1e6:.1f}), {r.tok_s:.0f} tok/s, {r.sol_fraction:.1%} SOL, kernel "
                  f"{dec.artifact.name} ({dec.artifact.regs} regs, {dec.artifact.dynamic_smem} B smem), "
                  f"spread {statistics.pstdev(times) * 1e6:.1f} µs", flush=True)
            if a.profile:
                tag = "".join(f"-{k}{int(v) if isinstance(v, bool) else v}" for k, v in extra.items())
                print(profile_summary(dec, f"{a.profile}/timeline-b{batch}-c{context}-rope{rope}-w"
                                           f"{dec.artifact.config.attn_warp_stages}{tag}.npz"), flush=True)
    print(format_table(rows))
    if a.json:
        write_json(rows, a.json, {"gpu": torch.cuda.get_device_name(0), "read_bw": bw, "reps": a.reps})


if __name__ == "__main__":
    main()
