"""The prefill's attention, one layer's call, in the ways it could be computed: the one FastPrefill
uses beside the candidates, timed in the same run, each checked against float32 attention.

    python benchmarks/prefill_attention.py --prompts 8192,32768 --chunk 8192 -o build/prefill-attention.json

A case is the last call of a prompt (``--chunk`` queries at the prompt's end, over a slab cache of
the whole prompt) through one sliding-window layer and one global layer of ``--config``. The ways:

* ``masked-blocks-B`` (sliding; B = 2048, the first of ``--blocks``, is FastPrefill's query_block): blocks of B queries, each
  over the keys its window reaches under a band mask, the KV heads repeated for their query group;
  the band is W of the B + W - 1 keys a block computes.
* ``masked-blocks-gqa-2048``: the first with SDPA's grouped-query support instead of the repeat.
* ``causal-repeat`` (global, FastPrefill's): SDPA causal over every earlier key, KV heads repeated.
* ``causal-gqa``: the same with SDPA's grouped-query support.
* ``flex``: torch.compile'd FlexAttention with a block mask of the band (sliding) or the causal
  triangle (global), grouped-query: only the blocks that hold allowed keys are computed. Its
  first call (its compile, on a GPU) is timed apart (``first_call_s``), as is building the block
  mask (``mask_ms``), which a call would do once for all its layers of a kind.

Each way's error is ||out - ref|| / ||ref|| over the first and last 256 queries, ref the same
attention in float32 over the bf16 inputs (bf16 outputs: expect a few 1e-3). Times are the median
of ``--reps`` runs after two untimed ones, CUDA events. ``--device cpu`` runs every way once on
small shapes, FlexAttention uncompiled (what tests/test_prefill.py checks), no timings.
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from mkc.ir.spec import load_spec
from mkc.runtime.prefill import FastPrefill, SlabKV

Attention = Callable[[torch.Tensor, SlabKV, int], torch.Tensor]  # (q [1, QH, T, D], cache, p0) -> out


def _ints(v: str) -> list[int]:
    return [int(x) for x in v.split(",") if x]


def band(window: int, p0: int) -> Callable:
    """FlexAttention's mask_mod: query i (position p0 + i) sees keys (p0 + i - window, p0 + i]."""
    def allowed(b, h, i, j):
        return (j <= i + p0) & (j > i + p0 - window)
    return allowed


def causal(p0: int) -> Callable:
    def allowed(b, h, i, j):
        return j <= i + p0
    return allowed


def reference(q: torch.Tensor, kv: SlabKV, p0: int, window: int, rows: torch.Tensor) -> torch.Tensor:
    """float32 attention of the queries ``rows`` of q [1, QH, T, D] over the cache: [1, QH, len(rows), D]."""
    QH, T = q.shape[1], q.shape[2]
    k, v = (t.float() for t in kv.read(0, 0, p0 + T))  # [G, S, D]
    k, v = (t.repeat_interleave(QH // t.shape[0], dim=0) for t in (k, v))
    qpos = (p0 + rows)[:, None]
    kpos = torch.arange(p0 + T, device=q.device)[None, :]
    allowed = (kpos <= qpos) & ((kpos > qpos - window) if window else True)
    return F.scaled_dot_product_attention(q[:, :, rows].float(), k[None], v[None], attn_mask=allowed)


def masked_blocks_gqa(q: torch.Tensor, kv: SlabKV, p0: int, window: int, block: int) -> torch.Tensor:
    """FastPrefill's sliding-window blocks with SDPA's enable_gqa in place of the repeated KV heads."""
    T = q.shape[2]
    p1 = p0 + T
    outs = []
    for b0 in range(0, T, block):
        q0, q1 = p0 + b0, min(p0 + b0 + block, p1)
        k0 = max(0, q0 + 1 - window)
        k, v = kv.read(0, k0, q1)
        qpos = torch.arange(q0, q1, device=q.device)[:, None]
        kpos = torch.arange(k0, q1, device=q.device)[None, :]
        allowed = (kpos <= qpos) & (kpos > qpos - window)
        mask = torch.zeros(q1 - q0, -(-(q1 - k0) // 16) * 16, dtype=q.dtype, device=q.device)
        mask = mask[:, :q1 - k0].masked_fill_(~allowed, float("-inf"))
        outs.append(F.scaled_dot_product_attention(q[:, :, q0 - p0:q1 - p0], k[None], v[None], attn_mask=mask,
                                                   enable_gqa=True))
    return torch.cat(outs, dim=2)


def causal_gqa(q: torch.Tensor, kv: SlabKV, p0: int) -> torch.Tensor:
    T = q.shape[2]
    k, v = kv.read(0, 0, p0 + T)
    if p0 == 0:
        return F.scaled_dot_product_attention(q, k[None], v[None], is_causal=True, enable_gqa=True)
    from torch.nn.attention.bias import causal_lower_right

    return F.scaled_dot_product_attention(q, k[None], v[None], attn_mask=causal_lower_right(T, p0 + T),
                                          enable_gqa=True)


def flex_way(compiled: bool, window: int, p0: int, T: int, device: str) -> tuple[Attention, float]:
    """FlexAttention over the slab's keys [0, p0 + T) with its block mask; (the way, the mask's ms)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    attend = torch.compile(flex_attention, dynamic=False) if compiled else flex_attention
    t0 = time.perf_counter()
    mask = create_block_mask(band(window, p0) if window else causal(p0), None, None, T, p0 + T, device=device)
    if device != "cpu":
        torch.cuda.synchronize()
    mask_ms = (time.perf_counter() - t0) * 1e3

    def run(q: torch.Tensor, kv: SlabKV, p0_: int) -> torch.Tensor:
        k, v = kv.read(0, 0, p0_ + q.shape[2])
        with warnings.catch_warnings():  # uncompiled on the CPU on purpose: for its values, not its speed
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            return attend(q, k[None], v[None], block_mask=mask, enable_gqa=True)
    return run, mask_ms


def ways(window: int, blocks: list[int]) -> dict[str, Attention]:
    """The SDPA ways of one layer kind: ``window`` > 0 a sliding layer, 0 a global one."""
    def fast(block: int) -> Attention:  # the method as FastPrefill runs it, with this query block
        fp = FastPrefill.__new__(FastPrefill)
        fp.query_block = block
        return lambda q, kv, p0: fp._sdpa(0, q, p0, kv, window)

    if not window:
        return {"causal-repeat": fast(2048), "causal-gqa": causal_gqa}
    out = {f"masked-blocks-{block}": fast(block) for block in blocks}
    out[f"masked-blocks-gqa-{blocks[0]}"] = lambda q, kv, p0: masked_blocks_gqa(q, kv, p0, window, blocks[0])
    return out


def run_case(prompt: int, chunk: int, window: int, heads: int, kv_heads: int, head_dim: int, device: str,
             reps: int, compiled: bool, blocks: list[int]) -> dict:
    T = min(chunk, prompt)
    p0 = prompt - T
    gen = torch.Generator(device=device).manual_seed(prompt * 7 + window)
    cache = [tuple(torch.randn(kv_heads, prompt, head_dim, generator=gen, device=device).to(torch.bfloat16)
                   for _ in range(2))]
    kv = SlabKV(cache)
    q = torch.randn(1, heads, T, head_dim, generator=gen, device=device).to(torch.bfloat16)
    rows = torch.cat([torch.arange(min(256, T)), torch.arange(max(0, T - 256), T)]).unique().to(device)
    ref = reference(q, kv, p0, window, rows)
    case: dict = {"prompt": prompt, "queries": T, "p0": p0, "window": window, "ways": {}}
    table: dict[str, Attention | None] = {**ways(window, blocks), "flex": None}  # flex's way is built below, timed
    for name, way in table.items():
        row: dict = {}
        try:
            if way is None:
                t0 = time.perf_counter()
                way, row["mask_ms"] = flex_way(compiled, window, p0, T, device)
                way(q, kv, p0)
                if device != "cpu":
                    torch.cuda.synchronize()
                row["first_call_s"] = round(time.perf_counter() - t0, 2)
            out = way(q, kv, p0)
            row["rel_err"] = float((out[:, :, rows].float() - ref).norm() / ref.norm())
            if device != "cpu":
                way(q, kv, p0)
                times = []
                for _ in range(reps):
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    way(q, kv, p0)
                    end.record()
                    end.synchronize()
                    times.append(start.elapsed_time(end))
                row["ms"] = round(sorted(times)[len(times) // 2], 3)
        except Exception as e:  # noqa: BLE001 - a way a backend refuses is reported; the others still run
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
        case["ways"][name] = row
    return case


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/north_mini_code.yaml")
    p.add_argument("--prompts", type=_ints, default=[8192, 32768], help="prompt lengths (tokens)")
    p.add_argument("--chunk", type=int, default=8192, help="queries of the call timed (the prompt's last)")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--blocks", type=_ints, default=[2048, 1024, 512],
                   help="query blocks of the masked sliding-window way (the first is FastPrefill's)")
    p.add_argument("--window", type=int, default=0, help="a sliding window other than the config's (small CPU runs)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("-o", "--output", default="build/prefill-attention.json")
    a = p.parse_args(argv)
    spec = load_spec(a.config)
    at = spec.attention
    kinds = {"sliding": (a.window or at.sliding_window) if any(l.attention == "sliding" for l in spec.layers) else 0,
             "global": 0 if any(l.attention != "sliding" for l in spec.layers) else None}
    layers = {k: sum((l.attention == "sliding") == (k == "sliding") for l in spec.layers) for k in kinds}
    if a.device == "cuda" and not torch.cuda.is_available():
        print("prefill_attention: error: no CUDA GPU here: expected one, or --device cpu")
        return 2
    cases = []
    for prompt in a.prompts:
        for kind, window in kinds.items():
            if window is None:
                continue
            case = run_case(prompt, a.chunk, window, at.num_heads, at.num_kv_heads, at.head_dim, a.device, a.reps,
                            compiled=a.device == "cuda", blocks=a.blocks)
            case["kind"], case["layers"] = kind, layers[kind]
            cases.append(case)
            print(f"{kind} layer, the last {case['queries']} queries of a {prompt}-token prompt "
                  f"(x {layers[kind]} layers):")
            for name, row in case["ways"].items():
                if "error" in row:
                    print(f"  {name:<24} {row['error']}")
                    continue
                ms = f"{row['ms']:8.3f} ms  x{layers[kind]} = {row['ms'] * layers[kind]:7.1f} ms" if "ms" in row else ""
                extra = f"  (first call {row['first_call_s']} s, mask {row['mask_ms']:.1f} ms)" if "first_call_s" in row else ""
                print(f"  {name:<24} {ms}  err {row['rel_err']:.2e}{extra}")
    gpu = torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu"
    Path(a.output).parent.mkdir(parents=True, exist_ok=True)
    Path(a.output).write_text(json.dumps({"gpu": gpu, "config": a.config, "chunk": a.chunk, "torch": torch.__version__,
                                          "cases": cases}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
