"""Render the persistent kernel's CUDA C++ from the schedule, the spec and templates/kernel.cu.j2.

The template only receives constants, the opcode table and names; every value is converted to
C++ text by ``mkc.codegen.cvalues``. The rendered source depends on the model's shapes, the
batch and tiling constants, never on the schedule's queues or the context bucket: the schedule
travels as data (``taskwords``), so one binary serves every context bucket of a batch size.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2

from mkc.codegen import cvalues as cv
from mkc.codegen.taskwords import DTYPE_CODES, MAX_RANK, RECORD_LAYOUT, parse_l2_warm
from mkc.codegen.weight_tiles import (
    GEMV_OPS,
    TILE_COLS,
    TILE_ROWS,
    WeightLayoutError,
    check_tileable,
    padded_k,
    padded_weights,
    stored_shape,
    tiled_weights,
)
from mkc.ir.fp8 import WEIGHT_FORMATS, is_fp8
from mkc.ir.kv_layout import page_size_of
from mkc.ir.ops import OP_INFO, Opcode
from mkc.ir.spec import ModelSpec
from mkc.ir.tiling import SMEM_BYTES
from mkc.schedule.schedule import Schedule


def _template_dir() -> Path:
    """templates/ of the source tree (editable install or PYTHONPATH=.), else the installed package."""
    src = Path(__file__).resolve().parents[2] / "templates"
    if (src / "kernel.cu.j2").is_file():
        return src
    import importlib.resources

    return Path(str(importlib.resources.files("mkc.templates")))


TEMPLATE_DIR = _template_dir()
KERNEL_TEMPLATE = "kernel.cu.j2"
KERNEL_NAME = "mkc_decode"
MAX_SMEM_BYTES = SMEM_BYTES  # Hopper: opt-in dynamic shared memory per block
STATIC_SMEM_RESERVE = 2 * 1024  # the kernel's static shared memory (task records, descriptors, routing)


ROUTING_ARGMAX = ("auto", "redux", "rank")  # CodegenOptions.routing_argmax
NORM_BESIDE_ROUTING = ("auto", "on", "off")  # CodegenOptions.norm_beside_routing
# "auto" for both: the ranked routing with the input normalised beside it at these batches, where
# the two together measured faster (each alone a tie, and slower at batch 4 and 8)
OPENING_AUTO_BATCHES = (1,)
TAGGED_LOGITS = ("auto", "on", "off")  # CodegenOptions.tagged_logits
TAGGED_LOGITS_MAX_BATCH = 4  # "auto": on up to this batch
L2_WARM_AUTO = "o_proj:expert_up"  # CodegenOptions.l2_warm = "auto" at L2_WARM_BATCHES
L2_WARM_BATCHES = (2, 3, 4)  # "auto" warm-up and evict-first streams (measured: no gain at 1, slower at 8)
EVICT_FIRST = ("auto", "on", "off")  # CodegenOptions.weights_evict_first
RESIDUAL_EPILOGUES = ("auto", "inline", "call")  # CodegenOptions.residual_epilogue


class CodegenError(ValueError):
    """The schedule or spec cannot be compiled; the message names the task or key and the limit."""


THREADS = 256  # threads per CTA (8 warps): the one size the kernel is verified at on a GPU


@dataclass(frozen=True, slots=True)
class CodegenOptions:
    """How the kernel is built for a schedule. Every choice here computes bitwise the same logits;
    the measurements behind each default are in docs/decisions.md."""

    gemv_unroll: int = 8  # 64-wide k blocks in flight per warp (halved for two row sets)
    # warps 1.. of an expert gate/up tile normalise its input while warp 0 routes (ops.cuh:
    # stage_norm_beside_routing): "on", "off", "auto" (on at OPENING_AUTO_BATCHES, where warp 0
    # routes alone)
    norm_beside_routing: str = "auto"
    spin_limit: int = 1 << 26  # polls of one counter wait before the device watchdog fires
    # GEMV weights as "rows" (the checkpoint's layout), "tiles" (tile order: every warp load reads
    # 512 contiguous bytes, mkc/codegen/weight_tiles.py; an error where the shapes do not allow it)
    # or "auto" (tiles where the shapes allow)
    weight_layout: str = "auto"
    # attention splits with one online softmax per warp over 16-key blocks, streamed through a
    # per-warp cp.async ring of this many blocks; lowered to what fits the shared memory; 0 (or
    # heads that do not fit the tensor-core Q.K): CTA-wide chunks
    attn_warp_stages: int = 2
    # the routing's top-k: "redux" (TOP_K rounds of two warp reductions), "rank" (one thread per
    # (token, expert) pair counts the better experts: ops.cuh rank_experts), "auto" ("rank" at
    # OPENING_AUTO_BATCHES, else "redux"); the same experts and weights either way
    routing_argmax: str = "auto"
    # a kernel for profiling: a profiled step also records when each task's inputs were staged and
    # its op was done (profile.format_phases)
    profile_phases: bool = False
    # expert-up tiles read the router logits' tagged copy (each logit with the step in one 8-byte
    # word) instead of waiting for the router tiles' counter: one round trip fewer on every MoE
    # layer's chain. "on", "off", "auto" (on up to TAGGED_LOGITS_MAX_BATCH; no gain at batch 8)
    tagged_logits: str = "auto"
    # the epilogue of a LINEAR tile that ends a layer (ops.cuh: store_with_residual): "inline",
    # "call" (one out-of-line function, whose code a tile after an expert-down tile waits to
    # fetch), "auto" (inline where the schedule has such tiles)
    residual_epilogue: str = "auto"
    # L2 warm-up: "TARGET:CARRIER" rules, comma-separated ("off": none; taskwords.L2_WARM_TARGETS):
    # while a carrier waits, its warps 1.. ask L2 for a share of a later tile's weights. "auto":
    # L2_WARM_AUTO at L2_WARM_BATCHES, else off
    l2_warm: str = "auto"
    # weight and KV streams load evict-first, so the lines warmed for later tiles stay: "on",
    # "off", "auto" (on at L2_WARM_BATCHES)
    weights_evict_first: str = "auto"
    # a normed GEMV tile skips its staging where the task before it on its SM staged the same
    # input. Measured slower, so off; it stays because taking its check out changed the shipped SASS
    reuse_staged_norm: bool = False


@dataclass(frozen=True, slots=True)
class KernelConfig:
    """Everything the template needs; derived from spec + schedule, independent of the context."""

    threads: int  # threads per CTA
    batch: int  # sequences per step (tokens of the GEMV B operand, <= 8)
    hidden: int  # residual-stream width (elements)
    head_dim: int  # elements per head
    page_size: int  # KV positions per cache page; 0: one contiguous slab per sequence
    group: int  # query heads per KV head
    top_k: int  # experts per token (1 for dense-only models)
    norm_eps: float
    rope_theta: float
    rope_interleaved: bool  # GPT-J pairs (2i, 2i+1), else NeoX halves (i, i + d/2)
    attn_scale: float  # softmax scale, head_dim^-0.5
    logit_scale: float
    router_sigmoid: bool  # expert weight = sigmoid(logit), else softmax over the top-k
    normalize_top_k: bool
    gemv_unroll: int
    gemv_max_k: int  # widest reduction of any GEMV task (elements)
    max_splits: int  # bound on attention splits per combine (num_sms, or the schedule's most)
    num_experts: int
    moe_slots: int
    spin_limit: int
    weights_tiled: bool  # GEMV weights in tile order (CodegenOptions.weight_layout, resolved)
    attn_warp_request: int  # CodegenOptions.attn_warp_stages (the fitted count: attn_warp_stages)
    routing_rank: bool  # CodegenOptions.routing_argmax, resolved, == "rank"
    norm_beside_routing: bool  # CodegenOptions.norm_beside_routing, resolved
    profile_phases: bool
    tagged_logits: bool  # CodegenOptions.tagged_logits, resolved
    # the residual terms of the largest LINEAR tile that ends a layer (ops.cuh: stage_residual_async),
    # staged in the RMSNorm's scratch; 0 without such tiles
    residual_stage_bytes: int = 0
    residual_epilogue_inline: bool = False  # CodegenOptions.residual_epilogue, resolved
    # rows / 64 of the fused expert tiles (EXPERT_MLP, all of one size); 0: the schedule has none
    fused_down_blocks: int = 0
    reuse_staged_norm: bool = False  # CodegenOptions.reuse_staged_norm
    l2_warm: str = "off"  # CodegenOptions.l2_warm, resolved: the rules the runtime encodes (taskwords.encode)
    weights_evict_first: bool = False  # CodegenOptions.weights_evict_first, resolved
    expert_down_split: bool = False  # the schedule has EXPERT_DOWN_SPLIT tiles (else op_expert_down_split is empty)
    # a GEMV reduction is not whole 64-column blocks: its staged input is zero-padded to them and its
    # weight stored with zero columns (weight_tiles.padded_weights)
    k_padded: bool = False
    weight_format: str = "bf16"  # the GEMV matrices' storage (LowerOptions.weights: mkc/ir/fp8.py)

    @property
    def warps(self) -> int:
        return self.threads // 32

    @property
    def gemv_xs_bytes(self) -> int:
        return _round(8 * (self.gemv_max_k + 32) * 2, 128)  # gemv.cuh: xs_ld = k + XS_PAD

    @property
    def gemv_bytes(self) -> int:
        """The GEMV's shared memory: the activations, the k-split reduction and the RMSNorm
        staging's scratch (gemv.cuh: NORM_SCRATCH_BYTES)."""
        f = 4
        red = self.warps * 2 * 4 * 32 * f  # gemv.cuh: GEMV_RED_FLOATS
        scratch = max(self.batch * self.hidden * f + self.hidden * 2, self.residual_stage_bytes)
        gemv = self.gemv_xs_bytes + red + scratch
        return _round(gemv, 128)

    @property
    def attn_ring_offset(self) -> int:
        """Where the warp splits' rings start (attention.cuh: ATTW_RING_OFF)."""
        qx = _round(8 * (self.head_dim + 32) * 2, 128)
        return _round(qx + (self.group + 2) * self.head_dim * 2 + (self.group + 1) * 4, 128)

    @property
    def attn_stage_bytes(self) -> int:
        """One block of a warp split's ring: 32 lanes x head_dim / 8 pieces of 16 bytes."""
        return 32 * (self.head_dim // 8) * 16

    @property
    def attn_warp_stages(self) -> int:
        """Blocks per warp ring of the warp splits: the request, lowered to what fits the shared
        memory; 0 (the CTA-wide chunks) when fewer than two fit or the heads do not fit the
        tensor-core Q.K (head_dim a multiple of 64, at most 8 query heads per KV head)."""
        if not self.attn_warp_request or self.head_dim % 64 or self.group > 8:
            return 0
        room = (MAX_SMEM_BYTES - STATIC_SMEM_RESERVE - self.attn_ring_offset) // (self.warps * self.attn_stage_bytes)
        stages = min(self.attn_warp_request, room)
        return stages if stages >= 2 else 0

    @property
    def smem_bytes(self) -> int:
        """Dynamic shared memory: the largest need of any op (bytes)."""
        f = 4
        gemv = self.gemv_bytes
        kl = self.threads // (self.head_dim // 8)
        qx = _round(8 * (self.head_dim + 32) * 2, 128)
        # the key-lane buffer, or a split's own q / k / v rows and qk-norm factors (ATT_RED_FLOATS)
        red = max(kl * self.head_dim, ((self.group + 2) * self.head_dim * 2 + (self.group + 1) * f + 3) // f)
        attn = qx + (self.warps * 4 * 32 + self.group * self.head_dim + self.group * self.threads
                     + red + 3 * self.group) * f
        # attention.cuh: V chunk (then every head's key-lane partials), 16-aligned
        attn = _round(attn, 16) + max(self.threads * self.head_dim * 2, self.group * kl * self.head_dim * f)
        if self.attn_warp_stages:  # attention.cuh: qx, the own rows, then a ring per warp
            attn = max(attn, self.attn_ring_offset + self.warps * self.attn_warp_stages * self.attn_stage_bytes)
        # weights, then partial sums
        combine = _round(self.batch * self.group * self.max_splits * f, 16) + self.threads * 4 * f
        # ops.cuh: positions, qk-norm factors, then the group's q/k/v rows of every sequence
        rope = 128 + _round(self.batch * (self.group + 1) * f, 128) + self.batch * (self.group + 2) * self.head_dim * 2
        return _round(max(gemv, attn, combine, rope), 128)


def _round(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def _gemv_k(schedule: Schedule, t) -> tuple[int, int, str]:
    """(k, k0, x operand) of a GEMV task."""
    b = schedule.buffers
    if t.op == Opcode.LINEAR:
        return t.arg("k"), t.arg("k0"), t.operand("x")
    if t.op == Opcode.EXPERT_DOWN_SPLIT:
        return t.arg("k"), t.arg("k0"), t.operand("h")
    if t.op == Opcode.EXPERT_DOWN:
        return b[t.operand("h")].shape[-1], 0, t.operand("h")
    return b[t.operand("weight")].shape[-1], 0, t.operand("x")


def _residual_stage_bytes(schedule: Schedule, t) -> int:
    """Shared memory a LINEAR tile that ends a layer stages its residual terms in: [terms][batch][rows]
    floats (ops.cuh: stage_residual_async, 16-byte copies of whole rows of each term)."""
    b = schedule.buffers
    rows, col0 = t.arg("rows"), t.arg("col0")
    terms = [t.operand(r) for r in ("residual", "mlp", "routed") if t.operand(r) != "-"]
    if rows % 4 or col0 % 4 or any(b[n].dtype != "f32" or b[n].shape[-1] % 4 for n in terms):
        raise CodegenError(f"task {t.id} ({t.name}): residual terms {', '.join(terms)} at columns {col0}..{col0 + rows}: "
                           f"expected f32 rows, with rows, col0 and the row width multiples of 4 (16-byte copies)")
    count = 1 + (t.operand("mlp") != "-") + (b[t.operand("routed")].shape[0] if t.operand("routed") != "-" else 0)
    return count * schedule.batch * rows * 4


def tile_order_problem(schedule: Schedule) -> str | None:
    """Why the GEMV weights of ``schedule`` cannot be stored in tile order, or None: every such
    weight needs whole 16 x 64 blocks and every GEMV tile must start on a block."""
    padded = padded_weights(schedule)
    for name in sorted(tiled_weights(schedule)):
        try:
            check_tileable(name, stored_shape(schedule.buffers[name].shape, name in padded))
        except WeightLayoutError as e:
            return str(e)
    for t in schedule.tasks:
        if t.op in GEMV_OPS:
            offsets = [(a, t.arg(a), TILE_ROWS) for a in ("row0", "up_row0") if a in OP_INFO[t.op].args]
            offsets += [("k0", _gemv_k(schedule, t)[1], TILE_COLS)]
            if t.op == Opcode.EXPERT_MLP:  # its rows are the down projection's columns
                offsets += [("row0 (the down projection's k0)", t.arg("row0"), TILE_COLS)]
            for arg, v, m in offsets:
                if v % m:
                    return f"task {t.id} ({t.name}): {arg} = {v}: tile-ordered weights need tiles starting at multiples of {m}"
    return None


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    """A CodegenOptions field that takes one of a few names."""
    if value not in choices:
        raise CodegenError(f"{name} = {value!r}: expected one of " + ", ".join(repr(c) for c in choices))


def _task_limits(schedule: Schedule, spec: ModelSpec) -> tuple[int, int, int, set[int], bool]:
    """What the tasks ask of the kernel, each checked (raises CodegenError naming the task): the
    widest GEMV reduction (in whole 64-column blocks), the largest residual staging of a tile that
    ends a layer, the most splits a combine merges, the rows of the fused expert tiles, and whether
    a reduction is not whole blocks (its staged input is padded with zeros: KernelConfig.k_padded)."""
    max_k, stage_bytes, max_splits, ragged = 64, 0, schedule.num_sms, False
    fused_rows = {t.arg("rows") for t in schedule.tasks if t.op == Opcode.EXPERT_MLP}
    if len(fused_rows) > 1:
        raise CodegenError(f"fused expert tiles of {sorted(fused_rows)} rows: the kernel compiles one size "
                           f"(LowerOptions.fused_experts lowers equal parts)")
    for t in schedule.tasks:
        if t.op in GEMV_OPS:
            k, k0, x = _gemv_k(schedule, t)
            if k % 8 or k0 % 64 or schedule.buffers[x].shape[-1] % 8:
                raise CodegenError(f"task {t.id} ({t.name}): reduction k = {k} at k0 = {k0} over {x} "
                                   f"{schedule.buffers[x].shape}: expected k % 8 == 0, k0 % 64 == 0 (whole "
                                   f"64-column blocks) and 16-byte aligned rows")
            ragged |= k % 64 != 0
            normed = t.operand("norm") != "-" if "norm" in OP_INFO[t.op].operands else False
            want = ("f32", (schedule.batch, spec.hidden_size)) if normed else ("bf16", None)
            xb = schedule.buffers[x]
            if xb.dtype != want[0] or (want[1] is not None and xb.shape != want[1]):
                raise CodegenError(f"task {t.id} ({t.name}): GEMV input {x} is {xb.dtype} {xb.shape}: expected "
                                   + ("the f32 residual stream [batch, hidden] (the task normalises it)" if normed
                                      else "bf16"))
            max_k = max(max_k, padded_k(k))
            if t.op == Opcode.LINEAR and t.operand("residual") != "-":
                stage_bytes = max(stage_bytes, _residual_stage_bytes(schedule, t))
            if t.op == Opcode.EXPERT_MLP:
                # ops.cuh: op_expert_mlp stages its hidden rows (the down projection's input, [8][rows +
                # 32] bf16) in the RMSNorm's scratch, whose rows have been normalised by then
                rows, scratch = t.arg("rows"), schedule.batch * spec.hidden_size * 4 + spec.hidden_size * 2
                if rows % 64 or t.arg("row0") % 64 or not normed or 8 * (rows + 32) * 2 > scratch:
                    raise CodegenError(f"task {t.id} ({t.name}): {rows} rows from row {t.arg('row0')}: a fused expert "
                                       f"tile's rows are its down projection's reduction: expected a normed input and "
                                       f"multiples of 64, at most {scratch // 16 - 32} rows")
        elif t.op == Opcode.ATTN_COMBINE:
            max_splits = max(max_splits, t.arg("splits"))  # the combine's shared memory (KernelConfig.smem_bytes)
    return max_k, stage_bytes, max_splits, fused_rows, ragged


def schedule_weight_format(schedule: Schedule) -> str:
    """The schedule's weight format (LowerOptions.weights, kept in its meta), checked against its
    buffers: FP8 matrices exactly where the format says so."""
    fmt = str(schedule.meta.get("weights", "bf16"))
    if fmt not in WEIGHT_FORMATS:
        raise CodegenError(f"schedule weights = {fmt!r}: expected one of {', '.join(WEIGHT_FORMATS)}")
    fp8 = sorted(n for n, b in schedule.buffers.items() if b.dtype == "fp8")
    if bool(fp8) != is_fp8(fmt):
        raise CodegenError(f"schedule weights = {fmt!r} but {len(fp8)} buffers are fp8: expected the lowering's "
                           f"weight format in the schedule's meta")
    return fmt


def kernel_config(schedule: Schedule, spec: ModelSpec, options: CodegenOptions | None = None) -> KernelConfig:
    """Derive and check the kernel constants (raises CodegenError naming what does not fit)."""
    options = options or CodegenOptions()
    a = spec.attention
    if not 1 <= schedule.batch <= 8:
        raise CodegenError(f"batch = {schedule.batch}: the GEMV tiles hold 1 to 8 tokens")
    if a.head_dim % 8 or THREADS % (a.head_dim // 8):
        raise CodegenError(f"'attention.head_dim' = {a.head_dim}: expected a multiple of 8 dividing "
                           f"{THREADS} threads into 16-byte lanes")
    group = a.num_heads // a.num_kv_heads
    if group > 8:
        raise CodegenError(f"{group} query heads per KV head: the attention tile holds at most 8")
    if spec.hidden_size % 8:
        raise CodegenError(f"'hidden_size' = {spec.hidden_size}: expected a multiple of 8 (16-byte rows)")
    moe = spec.moe
    top_k = moe.top_k if moe else 1
    if schedule.batch * top_k > THREADS:
        raise CodegenError(f"batch x top_k = {schedule.batch * top_k}: expected at most {THREADS}")
    if options.weight_layout not in ("auto", "rows", "tiles"):
        raise CodegenError(f"weight_layout = {options.weight_layout!r}: expected 'auto', 'rows' or 'tiles'")
    _check_choice("routing_argmax", options.routing_argmax, ROUTING_ARGMAX)
    _check_choice("norm_beside_routing", options.norm_beside_routing, NORM_BESIDE_ROUTING)
    _check_choice("tagged_logits", options.tagged_logits, TAGGED_LOGITS)
    _check_choice("residual_epilogue", options.residual_epilogue, RESIDUAL_EPILOGUES)
    l2_warm = options.l2_warm
    if l2_warm == "auto":
        l2_warm = L2_WARM_AUTO if schedule.batch in L2_WARM_BATCHES else "off"
    try:
        l2_warm = l2_warm if parse_l2_warm(l2_warm) else "off"
    except ValueError as e:
        raise CodegenError(str(e)) from None
    _check_choice("weights_evict_first", options.weights_evict_first, EVICT_FIRST)
    evict_first = options.weights_evict_first == "on" or (options.weights_evict_first == "auto"
                                                          and schedule.batch in L2_WARM_BATCHES)
    opening_auto = schedule.batch in OPENING_AUTO_BATCHES
    routing_argmax = options.routing_argmax if options.routing_argmax != "auto" else (
        "rank" if opening_auto else "redux")
    norm_beside = options.norm_beside_routing == "on" or (
        options.norm_beside_routing == "auto" and opening_auto)
    tagged_logits = options.tagged_logits == "on" or (options.tagged_logits == "auto"
                                                      and schedule.batch <= TAGGED_LOGITS_MAX_BATCH)
    problem = tile_order_problem(schedule) if options.weight_layout != "rows" else None
    if options.weight_layout == "tiles" and problem:
        raise CodegenError(problem)
    tiled = options.weight_layout != "rows" and problem is None
    max_k, stage_bytes, max_splits, fused_rows, ragged = _task_limits(schedule, spec)
    weight_format = schedule_weight_format(schedule)
    if is_fp8(weight_format) and not tiled:
        raise CodegenError(f"--weights {weight_format}: FP8 weights are read in tile order only, and "
                           f"{problem or 'weight_layout = rows was asked for'}: expected bf16 weights")
    if is_fp8(weight_format) and ragged:
        raise CodegenError(f"--weights {weight_format}: a reduction off the 64-column blocks reads bf16 weights "
                           f"only: expected --weights bf16")
    short = [n for n in padded_weights(schedule) if schedule.buffers[n].dtype == "fp8"]
    if short:  # an FP8 matrix is stored as given (mkc/ir/fp8.py): no zero rows
        raise CodegenError(f"--weights {weight_format}: FP8 matrix {short[0]} {schedule.buffers[short[0]].shape} is not "
                           f"whole 16-row blocks: expected --weights bf16")
    cfg = KernelConfig(
        threads=THREADS, batch=schedule.batch, hidden=spec.hidden_size, head_dim=a.head_dim,
        page_size=page_size_of(schedule.buffers), group=group, top_k=top_k,
        norm_eps=spec.norm_eps, rope_theta=a.rope_theta, rope_interleaved=a.rope_style == "interleaved",
        attn_scale=a.head_dim ** -0.5, logit_scale=spec.logit_scale,
        router_sigmoid=(moe.scoring == "sigmoid") if moe else True,
        normalize_top_k=moe.normalize_top_k if moe else False, gemv_unroll=options.gemv_unroll,
        gemv_max_k=max_k, max_splits=max_splits, num_experts=moe.num_experts if moe else 1,
        moe_slots=moe.slots(schedule.batch) if moe else 1, spin_limit=options.spin_limit,
        weights_tiled=tiled, weight_format=weight_format, attn_warp_request=options.attn_warp_stages, routing_rank=routing_argmax == "rank",
        norm_beside_routing=norm_beside, profile_phases=options.profile_phases, tagged_logits=tagged_logits,
        residual_stage_bytes=stage_bytes, reuse_staged_norm=options.reuse_staged_norm,
        fused_down_blocks=next(iter(fused_rows), 0) // 64, l2_warm=l2_warm, weights_evict_first=evict_first,
        expert_down_split=any(t.op == Opcode.EXPERT_DOWN_SPLIT for t in schedule.tasks), k_padded=ragged,
        residual_epilogue_inline=options.residual_epilogue == "inline" or (options.residual_epilogue == "auto"
                                                                           and stage_bytes > 0))
    if cfg.smem_bytes > MAX_SMEM_BYTES:
        raise CodegenError(f"shared memory {cfg.smem_bytes} B (widest GEMV k = {max_k}, batch = {cfg.batch}): "
                           f"expected at most {MAX_SMEM_BYTES} B")
    return cfg


def environment(template_dir: Path = TEMPLATE_DIR) -> jinja2.Environment:
    """The one Jinja environment: StrictUndefined, so a missing variable fails at render time."""
    return jinja2.Environment(loader=jinja2.FileSystemLoader(str(template_dir)), undefined=jinja2.StrictUndefined,
                              trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True,
                              autoescape=False)


def template_context(cfg: KernelConfig, banner: str) -> dict[str, Any]:
    """Template variables: C++ text only (cvalues), plus the opcode table."""
    opcodes = [{"name": cv.c_ident(op.name), "value": cv.c_int(int(op)),
                "operands": [cv.c_ident(r) for r in OP_INFO[op].operands],
                "args": [cv.c_ident(x) for x in OP_INFO[op].args]} for op in Opcode]
    return {
        "banner": cv.c_comment(banner),
        "kernel_name": cv.c_ident(KERNEL_NAME),
        "threads": cv.c_int(cfg.threads),
        "batch": cv.c_int(cfg.batch),
        "head_dim": cv.c_int(cfg.head_dim),
        "page_size": cv.c_int(cfg.page_size),
        "paged": cfg.page_size > 0,  # a Python bool for the template's {% if %}
        "group": cv.c_int(cfg.group),
        "top_k": cv.c_int(cfg.top_k),
        "hidden": cv.c_int(cfg.hidden),
        "num_experts": cv.c_int(cfg.num_experts),
        "moe_slots": cv.c_int(cfg.moe_slots),
        "norm_eps": cv.c_float(cfg.norm_eps),
        "rope_theta": cv.c_float(cfg.rope_theta),
        "rope_interleaved": cv.c_bool(cfg.rope_interleaved),
        "attn_scale": cv.c_float(cfg.attn_scale),
        "logit_scale": cv.c_float(cfg.logit_scale),
        "router_sigmoid": cv.c_bool(cfg.router_sigmoid),
        "normalize_top_k": cv.c_bool(cfg.normalize_top_k),
        "gemv_unroll": cv.c_int(cfg.gemv_unroll),
        "gemv_xs_bytes": cv.c_int(cfg.gemv_xs_bytes),
        "smem_bytes": cv.c_int(cfg.smem_bytes),
        "spin_limit": cv.c_uint(cfg.spin_limit),
        "weights_tiled": cv.c_bool(cfg.weights_tiled),
        "weight_format": cv.c_int(WEIGHT_FORMATS.index(cfg.weight_format)),
        "attn_warp_stages": cv.c_int(cfg.attn_warp_stages),
        "routing_rank": cv.c_bool(cfg.routing_rank),
        "norm_beside_routing": cv.c_bool(cfg.norm_beside_routing),
        "profile_phases": cv.c_bool(cfg.profile_phases),
        "tagged_logits": cv.c_bool(cfg.tagged_logits),
        "residual_epilogue_inline": cv.c_int(int(cfg.residual_epilogue_inline)),  # a preprocessor 0 / 1
        "reuse_staged_norm": cv.c_bool(cfg.reuse_staged_norm),
        "fused_down_blocks": cv.c_int(cfg.fused_down_blocks),
        "expert_down_split": cv.c_bool(cfg.expert_down_split),
        "k_padded": cv.c_bool(cfg.k_padded),
        "l2_warm": cv.c_bool(cfg.l2_warm != "off"),
        "weights_evict_first": cv.c_bool(cfg.weights_evict_first),
        "max_rank": cv.c_int(MAX_RANK),
        "dtypes": [(cv.c_ident(f"DT_{k.upper()}"), cv.c_int(v)) for k, v in DTYPE_CODES.items()],
        "record_words": [(cv.c_ident(k), cv.c_int(v)) for k, v in RECORD_LAYOUT],
        "opcodes": opcodes,
    }


def render_source(cfg: KernelConfig, banner: str, template_dir: Path = TEMPLATE_DIR) -> str:
    """The kernel's CUDA C++ source (raises jinja2.UndefinedError if the template needs more)."""
    return environment(template_dir).get_template(KERNEL_TEMPLATE).render(**template_context(cfg, banner))


def template_files(template_dir: Path = TEMPLATE_DIR) -> list[Path]:
    """Every file the kernel is built from (part of the cache key)."""
    return sorted([*template_dir.glob("*.cu.j2"), *template_dir.glob("*.cuh")])
