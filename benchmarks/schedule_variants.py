"""Step time of schedules made with different cost-model assumptions or lowerings, side by side in one run.

    python benchmarks/schedule_variants.py --batch 1 8 --context 8192 [--reps 20] [--variants NAME ...] \
        [--attention-sms 0 32 ...] [--rope-in-splits yes no] [--residual-in-o-proj yes no] [--fused-experts yes no] \
        [--global-attention-sms 0 128 256] [--expert-up-rows rule 80x6+48x6] [--expert-down-rows 0 256]
        [--rounds 2] [--build-only]

Every variant runs the default kernel over the same weights and KV cache; only the scheduler's
cost model (mkc/schedule/cost.py: Ceilings) or the lowering's SM split between the attention
splits and the expert tiles of a parallel block (LowerOptions.attention_sms) differs, so only the
tiles, placement, queue order and counters change. The profile of 2026-11-29 (BENCHMARKS.md, "Where the
time goes now") found the model optimistic between tasks: it credits up to 96 KB of prefetch per
task as overlap with its wait and charges 0.6 µs per hand-off, while the critical chain measured
0.75 µs a hop and no overlap. Timing as megakernel_step.py: one warm-up, then ``reps`` steps timed
one by one with CUDA events, median; after each batch a side-by-side summary (every variant's rounds,
their mean and its change against the first variant's, runtime/bench.py: format_rounds) names each
variant by what sets it apart from the others. ``default`` is what ships: with the attention SMs chosen by
the planner (auto), a raise of the splits' inputs' priority recorded in the tuning table applies to
it too (configs/tuning/h200.json: batch 4 at 8K), so there it schedules as attention-inputs-first.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import torch

from mkc.codegen.build import build_kernel
from mkc.codegen.render import CodegenOptions
from mkc.ir.spec import load_spec
from mkc.runtime.bench import (
    bench_tokens,
    decoder_in_place,
    device_random_weights,
    fill_bench_kv,
    format_rounds,
    in_turn,
    measure_read_bandwidth,
    time_step,
)
from mkc.schedule import tuning
from mkc.schedule.cost import H200, OP_FIXED_US
from mkc.schedule.plan import plan

ROOT = Path(__file__).resolve().parents[1]

REFIT_FIXED_US = {**OP_FIXED_US, "TOPK": 4.0, "ROPE_APPEND": 3.3, "ATTN_COMBINE": 4.0, "LINEAR": 0.5,
                  "EXPERT_SWIGLU": 4.5, "EXPERT_DOWN": 0.0}

VARIANTS = {
    "default": H200,
    "no-prefetch-credit": dataclasses.replace(H200, prefetch_bytes=0),
    "no-credit-1us-hops": dataclasses.replace(H200, prefetch_bytes=0, task_overhead=1.0e-6),
    # the streaming rate the profile measured per SM while all stream (~24 GB/s, 3.2 TB/s in all)
    "measured-rate": dataclasses.replace(H200, read_bw=3.2e12, prefetch_bytes=0, task_overhead=0.75e-6),
    "measured-rate-credit": dataclasses.replace(H200, read_bw=3.2e12, task_overhead=0.75e-6),
    # attention splits at the fair per-SM share, as every other task (the default until 2026-11-30
    # is a split rate of 16 GB/s, cost.py: Ceilings.split_bw)
    "split-fair-share": dataclasses.replace(H200, split_bw=0.0),
    # fixed times refitted to the batch-1 profile of 2026-11-30 09:37 UTC (benchmarks/calibrate_cost.py:
    # run time at zero bytes; the GEMVs' run starts after the weights issued before the wait, so
    # theirs is near 0), with and without the prefetch credit
    "refit": dataclasses.replace(H200, op_fixed_us=REFIT_FIXED_US),
    "refit-no-credit": dataclasses.replace(H200, op_fixed_us=REFIT_FIXED_US, prefetch_bytes=0),
    # the tiles that feed the attention splits (QKV) ranked 100 µs higher, so they go ahead of the
    # expert tiles on an SM (replay of a batch-8 profile, 2026-11-30: -2.7%; measured 17:57-17:59
    # UTC: batch 4 -3.8%, batch 8 a tie, batch 2 +1.3%; batch 1's schedule is the default's)
    "attention-inputs-first": dataclasses.replace(H200, attention_inputs_first_us=100.0),
    # ... and sibling tiles spread over SMs (Ceilings.spread_siblings): the shipped schedule of batch
    # 4 at 8K (configs/tuning/h200.json, measured 2026-12-01 04:06 UTC), for another attention-SM count
    "inputs-first-spread": dataclasses.replace(H200, attention_inputs_first_us=100.0, spread_siblings=True),
    # sibling tiles spread alone: batch 2 at 8K's shipped schedule
    "spread": dataclasses.replace(H200, spread_siblings=True),
    # the splits ranked first too (Ceilings.splits_first; measured 2026-12-01 05:05 UTC: batch 8 -1.5%,
    # batch 4 +1.0%, +4.3% with the spread)
    "splits-first": dataclasses.replace(H200, attention_inputs_first_us=100.0, splits_first=True),
    "splits-first-spread": dataclasses.replace(H200, attention_inputs_first_us=100.0, splits_first=True,
                                               spread_siblings=True),
}


def chosen(lowering: dict) -> dict:
    """The lowering choices to pass to plan(): "auto" ones left out, so the planner makes them as
    mkc bench does (residual_in_o_proj "yes" / "no" as a bool, global_attention_sms as an int)."""
    out = {k: v for k, v in lowering.items() if v != "auto"}
    if "residual_in_o_proj" in out:
        out["residual_in_o_proj"] = out["residual_in_o_proj"] == "yes"
    for name in ("global_attention_sms", "expert_down_rows"):
        if name in out:
            out[name] = int(out[name])
    return out


def variant_key(variant: tuple) -> str:
    """A variant (attention SMs, lowering choices, cost-model variant) as a dictionary key."""
    att, lowering, name = variant
    return repr((att, sorted(lowering.items()), name))


def short_name(variant: tuple, variants: list[tuple]) -> str:
    """A variant named by what sets it apart from the others of the run (the attention-SM count, the
    lowering choices and the cost-model variant that differ between them), for the side-by-side
    summary; "default" where the run has one variant."""
    att, lowering, name = variant
    parts = []
    if len({v[0] for v in variants}) > 1:
        parts.append(f"attention_sms={'auto' if att is None else att}")
    for k in sorted({k for v in variants for k in v[1]}):
        if len({repr(v[1].get(k)) for v in variants}) > 1:
            value = lowering.get(k, "auto")
            if isinstance(value, tuple):  # expert tile rows: () is the tiling rule's
                value = "+".join(map(str, value)) or "rule"
            parts.append(f"{k}={value}")
    if len({v[2] for v in variants}) > 1:
        parts.append(name)
    return ", ".join(parts) or "default"


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "north_mini_code.yaml"))
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--attention-sms", nargs="+", default=["auto"],
                    help="LowerOptions.attention_sms values to lower with: numbers (0: every op fills all "
                         "SMs) or auto (the compiler's choice, mkc/schedule/plan.py)")
    ap.add_argument("--rope-in-splits", nargs="+", default=["yes"], choices=["yes", "no"],
                    help="LowerOptions.rope_in_splits values to lower with (no: a ROPE_APPEND task rotates q "
                         "and the splits wait for it)")
    ap.add_argument("--residual-in-o-proj", nargs="+", default=["auto"], choices=["yes", "no", "auto"],
                    help="LowerOptions.residual_in_o_proj values to lower with (yes: the O-projection tiles "
                         "add the residual and the MLP's output, no RESIDUAL tiles; auto, the default: the "
                         "planner's choice, as mkc bench and mkc compile make it)")
    ap.add_argument("--fused-experts", nargs="+", default=["no"], choices=["yes", "no"],
                    help="LowerOptions.fused_experts values to lower with (yes: EXPERT_MLP tiles, each its "
                         "rows' gate, up and share of the down projection; needs --residual-in-o-proj yes)")
    ap.add_argument("--global-attention-sms", nargs="+", default=["auto"],
                    help="LowerOptions.global_attention_sms values to lower with (the SMs' worth of splits "
                         "of the layers of global attention; 0: as --attention-sms; auto, the default: the "
                         "planner's choice)")
    ap.add_argument("--expert-up-rows", nargs="+", default=["auto"],
                    help="LowerOptions.expert_up_rows values to lower with: 'rule' (equal tiles), each "
                         "slot's tile rows as SIZExCOUNT terms joined by '+', such as 80x6+48x6, or auto, "
                         "the default (the planner's choice)")
    ap.add_argument("--expert-down-rows", nargs="+", default=["auto"],
                    help="LowerOptions.expert_down_rows values to lower with (0: the tiling rule's "
                         "expert-down tiles; auto, the default: the planner's choice)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="time every variant this many times, in turn, every other round in reverse order "
                         "(drift between variants shows; a place in the round weighs on every variant alike)")
    ap.add_argument("--build-only", action="store_true",
                    help="compile every variant's kernel (no GPU) and exit")
    ap.add_argument("--sms", type=int, default=132, help="SM count for --build-only")
    a = ap.parse_args()
    a.attention_sms = [None if v == "auto" else int(v) for v in a.attention_sms]
    return a


def variants_of(a: argparse.Namespace) -> list[tuple]:
    """Every combination of the values given: (attention SMs, lowering choices, cost-model variant)."""
    def up_rows(er: str):
        return er if er == "auto" else () if er == "rule" else tuning.row_list(er)

    return [(att, chosen({"rope_in_splits": rope == "yes", "residual_in_o_proj": fold,
                          "fused_experts": fx == "yes", "global_attention_sms": ga,
                          "expert_up_rows": up_rows(er), "expert_down_rows": dr}), name)
            for att in a.attention_sms for rope in a.rope_in_splits for fold in a.residual_in_o_proj
            for fx in a.fused_experts for ga in a.global_attention_sms for er in a.expert_up_rows
            for dr in a.expert_down_rows for name in a.variants]


def describe(sc, att: int | None, lowering: dict) -> str:
    """A variant's attention SMs and lowering choices as planned, for its line of the output."""
    label = f"{sc.meta['attention_sms']['chosen']}" + (" (auto)" if att is None else "")
    label += f", rope in splits {'yes' if lowering['rope_in_splits'] else 'no'}"
    label += f", residual in o_proj {'yes' if sc.meta['residual_in_o_proj'] else 'no'}"
    label += f", fused experts {'yes' if lowering['fused_experts'] else 'no'}"
    label += f", global attention SMs {sc.meta['global_attention_sms'] or 'same'}"
    if sc.meta["expert_down_rows"]:
        label += f", expert-down tile rows {sc.meta['expert_down_rows']}"
    if sc.meta["expert_up_rows"]:
        label += f", expert tile rows {'+'.join(map(str, sc.meta['expert_up_rows']))}"
    return label


def build_only(spec, options: CodegenOptions, variants: list[tuple], a: argparse.Namespace) -> None:
    """--build-only: compile every variant's kernel for --sms SMs and print its registers and spills."""
    for batch in a.batch:
        for att, lowering, name in variants:
            sc = plan(spec, batch, a.context, a.sms, attention_sms=att, ceilings=VARIANTS[name], **lowering)
            art = build_kernel(sc, spec, options)
            print(f"b{batch} attention_sms={sc.meta['attention_sms']['chosen']} {lowering} {name}: "
                  f"{art.name} regs {art.regs} spills {art.spills}")


def main() -> None:
    a = parse_args()
    spec = load_spec(a.config)
    options = CodegenOptions()
    variants = variants_of(a)
    if a.build_only:
        build_only(spec, options, variants, a)
        return
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    bw = measure_read_bandwidth()
    weights = device_random_weights(spec, 2026)
    print(f"read bandwidth {bw / 1e12:.2f} TB/s")
    for batch in a.batch:
        times_us = time_batch(spec, weights, options, variants, a, batch, sms=sms, bw=bw)
        print(format_rounds(batch, times_us), flush=True)


def time_batch(spec, weights: dict[str, torch.Tensor], options: CodegenOptions, variants: list[tuple],
               a: argparse.Namespace, batch: int, *, sms: int, bw: float) -> dict[str, list[float]]:
    """Every variant's step at one batch, in turn for --rounds rounds, each line printed as it is
    measured; returns each variant's step times (µs) by its short name."""
    # the same tokens, positions and KV cache for every variant of a batch (mkc bench's)
    tokens = bench_tokens(spec, batch)
    positions = torch.full((batch,), a.context - 1, dtype=torch.int32)
    ref = None
    plans = {}  # each variant planned once (planning is deterministic; it takes seconds per plan)
    names = {variant_key(v): short_name(v, variants) for v in variants}
    times_us: dict[str, list[float]] = {n: [] for n in names.values()}
    for att, lowering, name in in_turn(variants, a.rounds):
        key = variant_key((att, lowering, name))
        if key not in plans:
            plans[key] = plan(spec, batch, a.context, sms, attention_sms=att, ceilings=VARIANTS[name],
                              **lowering)
        sc = plans[key]
        label = describe(sc, att, lowering)
        with decoder_in_place(sc, spec, weights, options=options) as dec:
            fill_bench_kv(dec, spec)
            logits, _ = dec.step(tokens, positions)
            repeat = torch.equal(logits, dec.step(tokens, positions)[0])
            if ref is None:
                ref = logits.clone()
            # another lowering sums in another order, and on random weights a routing near-tie can
            # flip: the logits may differ; the GPU tests check each lowering against the executor
            diff = float((ref - logits).abs().max()) / float(ref.abs().max())
            same = (f"logits within {diff:.2e} of the first's largest, argmax "
                    + ("equal" if torch.equal(ref.argmax(-1), logits.argmax(-1)) else "DIFFERS")
                    + ", rerun " + ("bitwise the same" if repeat else "DIFFERS (a race)"))
            med, sol, _ = time_step(dec, spec, batch, a.context, bw, a.reps)
            times_us[names[key]].append(med * 1e6)
            print(f"batch {batch} attention_sms {label:<110} {name:<20} measured {med * 1e6:8.1f} µs "
                  f"({sol:.1%} SOL), predicted {sc.predicted['step_us']:8.1f} µs; {same}", flush=True)
    return times_us


if __name__ == "__main__":
    main()
