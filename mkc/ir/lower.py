"""Lowering: ModelSpec → buffers and tile tasks in program order (then edges from regions).

Each ``_emit_*`` function lowers one tensor-level op of the op graph into tiles. A task declares
every region it reads and writes; nothing here lists a dependency by hand. Buffers are per layer,
so the only reuse across tasks inside one step is the KV cache (written once per step, then read).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass

from mkc.ir.fp8 import WEIGHT_FORMATS, is_fp8, scale_bytes
from mkc.ir.graph import DTYPE_BYTES, Buffer, Program, Region, Task, derive_edges
from mkc.ir.kv_layout import pages_per_seq
from mkc.ir.ops import OP_INFO, Opcode
from mkc.ir.spec import ModelSpec, SpecError
from mkc.ir.tiling import K_BLOCK, attention_split_keys, combine_heads, gemv_max_k, k_splits, row_tile, tiles


@dataclass(frozen=True, slots=True)
class LowerOptions:
    batch: int  # sequences decoded together (1-8)
    context: int  # context bucket: the KV cache holds this many positions per sequence
    num_sms: int  # persistent CTAs (one per SM)
    page_size: int = 0  # KV positions per cache page; 0: one contiguous slab per sequence (kv_layout.py)
    kv_pages: int = 0  # pages in each layer's pool; 0: batch x pages per sequence (every slot full)
    # parallel block: SMs whose one wave the attention splits fill, while the MLP tiles fill the
    # other SMs, so the two branches run side by side; 0: every op fills all SMs (mkc/schedule/plan.py)
    attention_sms: int = 0
    # the same for the layers whose attention spans the whole context (global attention): SMs'
    # worth of splits (batch x KV heads streams, each cut into global_attention_sms // streams
    # splits), up to MAX_ATTENTION_WAVES waves of the GPU, since at a long context their keys
    # outweigh the rest of the layer (North Mini Code at 128K, batch 1: 268 MB of KV against 75 MB
    # of routed experts); 0: as attention_sms. The sliding-window layers keep attention_sms.
    global_attention_sms: int = 0
    # each attention split rotates (and qk-norms) its query heads from the QKV output itself and
    # takes this step's key and value from there, so the splits wait for the QKV tiles only: one
    # task and one hop fewer on the attention chain. The ROPE_APPEND task then only appends k and v
    # to the KV cache, after the splits (no one in the step waits for it). False: ROPE_APPEND
    # rotates q too and appends first, and the splits wait for it: measured slower, it stays because
    # its device path (the q operands and their branches) is part of the shipped kernels' SASS.
    rope_in_splits: bool = True
    # the O-projection ends the layer: one GEMV over every head (no split-K partials by KV group)
    # whose tiles add the residual stream and the MLP's output (a dense MLP's, or every routing
    # slot's expert output) and write the next layer's residual stream, so no RESIDUAL task (and
    # its hand-off) follows them on the layer's chain. Its tiles wait for the whole attention and
    # the MLP. False: O-projection partials per KV group, then RESIDUAL tiles that sum them. In a
    # sequential block the O-projection ends the attention half (x + attn) and a dense MLP's down
    # projection (unsplit along k) ends the layer the same way.
    residual_in_o_proj: bool = False
    # each expert tile also multiplies its rows of the hidden state by its slice of the expert's
    # down projection (EXPERT_MLP: split-K partials [slot * parts + part, B, hidden], summed by the
    # O-projection tiles that end the layer), so no EXPERT_DOWN tile and no hand-off between the
    # expert's two GEMVs sits on the layer's chain. Needs residual_in_o_proj and a parallel block.
    # Measured slower, so off; it stays because the kernel loop's test for its opcode is part of
    # the shipped kernels' SASS.
    fused_experts: bool = False
    # rows of each expert gate/up tile of a routing slot, in order (multiples of 16 that add up to
    # the expert's intermediate size); (): the tiling rule's equal tiles. A tuning entry may name
    # them per point (plan.py: EXPERT_UP_ROWS; North Mini Code at batch 4: six tiles of 128 rows)
    expert_up_rows: tuple[int, ...] = ()
    # rows per expert-down tile; 0: the tiling rule's (about one tile per SM over every slot: North
    # Mini Code at batch 1, 16 tiles of 128 rows per slot; at batch 8, 2 of 1024). Smaller tiles (a
    # multiple of 16; the last may be shorter) spread the down projection of the slots whose gate/up
    # tiles end last over more SMs, at more hand-offs in all. A tuning entry may name it per point
    # (plan.py: EXPERT_DOWN_ROWS; North Mini Code at batch 8, 256 rows; docs/tiling.md).
    expert_down_rows: int = 0
    # how the matrices a GEMV streams are stored: "bf16", "fp8" (e4m3, a scale per output row) or
    # "fp8-block" (a scale per 128 x 128 block); embeddings, norms and routers stay bf16 (mkc/ir/fp8.py)
    weights: str = "bf16"
    # the widest reduction one GEMV task takes over a staged input; 0: what fits the shared memory
    # (tiling.gemv_max_k). A wider MLP down projection is split along k (tiling.k_splits)
    max_gemv_k: int = 0

    def check(self) -> None:
        if self.weights not in WEIGHT_FORMATS:
            raise SpecError(f"--weights {self.weights}: expected one of {', '.join(WEIGHT_FORMATS)}")
        if self.fused_experts and is_fp8(self.weights):
            raise SpecError(f"fused_experts with --weights {self.weights}: the fused expert tiles read bf16 "
                            f"weights: expected fused_experts off")
        if not 1 <= self.batch <= 8:
            raise SpecError(f"--batch {self.batch}: expected 1 to 8")
        if self.context < 1:
            raise SpecError(f"--context {self.context}: expected a positive number of positions")
        if self.num_sms < 1:
            raise SpecError(f"--num-sms {self.num_sms}: expected at least 1")
        if not 0 <= self.global_attention_sms <= MAX_ATTENTION_WAVES * self.num_sms:
            raise SpecError(f"--global-attention-sms {self.global_attention_sms}: expected 0 (as --attention-sms) or up "
                            f"to {MAX_ATTENTION_WAVES} waves of the {self.num_sms} SMs "
                            f"({MAX_ATTENTION_WAVES * self.num_sms}) worth of attention splits")
        if not 0 <= self.attention_sms < self.num_sms:
            raise SpecError(f"--attention-sms {self.attention_sms}: expected 0 (every op fills all SMs) or fewer "
                            f"than the {self.num_sms} SMs, so the MLP tiles keep some")
        if self.page_size < 0 or self.page_size > self.context:
            raise SpecError(f"--page-size {self.page_size}: expected 0 (contiguous) or 1 to the context "
                            f"({self.context}) positions per KV page")
        if self.fused_experts and not self.residual_in_o_proj:
            raise SpecError("fused_experts: the expert tiles' split-K partials are summed by the O-projection tiles "
                            "that end the layer: expected residual_in_o_proj as well")
        if self.expert_up_rows and self.fused_experts:
            raise SpecError("expert_up_rows with fused_experts: the fused tiles keep equal parts: expected one of "
                            "the two")
        if any(r <= 0 or r % 16 for r in self.expert_up_rows):
            raise SpecError(f"expert_up_rows = {tuple(self.expert_up_rows)}: expected positive multiples of 16 (the "
                            f"GEMV's row group)")
        if self.expert_down_rows < 0 or self.expert_down_rows % 16:
            raise SpecError(f"expert_down_rows = {self.expert_down_rows}: expected 0 (the tiling rule) or a positive "
                            f"multiple of 16 (the GEMV's row group)")
        if self.max_gemv_k < 0 or self.max_gemv_k % K_BLOCK:
            raise SpecError(f"max_gemv_k = {self.max_gemv_k}: expected 0 (what fits the shared memory) or a "
                            f"positive multiple of {K_BLOCK} (the GEMV's reduction block)")
        if self.kv_pages < 0 or (self.kv_pages and not self.page_size):
            raise SpecError(f"kv_pages = {self.kv_pages}: expected 0, or a pool size with a page size")


# LowerOptions.global_attention_sms: at most this many waves of the SMs' worth of attention splits
MAX_ATTENTION_WAVES = 4



@dataclass(frozen=True, slots=True)
class Normed:
    """The RMSNorm of the f32 residual stream ``x`` with ``weight``, as a GEMV input: never
    materialised, each consumer task stages it itself (mkc/ir/ops.py)."""

    x: Buffer
    weight: Buffer


def gemv_input(x: Buffer | Normed, k0: int = 0, k: int | None = None) -> tuple[dict[str, Buffer | None], list[Region]]:
    """Operands ("x", "norm") and read regions of a GEMV's input columns [k0, k0 + k): a normed
    input reads whole rows of x (the norm's mean is over the row) and the norm weight."""
    if isinstance(x, Normed):
        return {"x": x.x, "norm": x.weight}, [full(x.x), full(x.weight)]
    k = x.shape[-1] if k is None else k
    return {"x": x, "norm": None}, [box(x, None, (k0, k0 + k))]


def full(buf: Buffer) -> Region:
    return Region(buf.name, tuple((0, s) for s in buf.shape))


def box(buf: Buffer, *ranges: tuple[int, int] | None) -> Region:
    """Region of buf; None for a dim means the whole dim."""
    return Region(buf.name, tuple(r if r is not None else (0, s) for r, s in zip(ranges, buf.shape)))


@dataclass(frozen=True, slots=True)
class _AttentionOperands:
    """One layer's attention inputs: the QKV projection's output, the rotated queries, the KV
    cache and the qk-norm weights, as its ROPE_APPEND and ATTN_SPLIT tasks read and write them."""

    qkv: Buffer  # [B, (heads + 2 kv_heads) * head_dim]: q heads, then k heads, then v heads
    q: Buffer | None  # [B, heads * head_dim] after RoPE; None: the splits rotate q (rope_in_splits)
    k_cache: Buffer  # [B, kv_heads, ctx, head_dim], or paged [kv_heads, pages, page_size, head_dim]
    v_cache: Buffer  # as k_cache
    page_table: Buffer | None  # [B, pages per sequence]; None: one contiguous slab per sequence
    q_norm: Buffer | None  # [head_dim] qk-norm weights, shared by every head; None: no qk-norm
    k_norm: Buffer | None  # [head_dim]
    heads: int  # query heads
    kv_heads: int
    head_dim: int

    @property
    def group(self) -> int:
        """Query heads per KV head."""
        return self.heads // self.kv_heads

    def head_rows(self, g: int, b: int | None = None, krange: tuple[int, int] | None = None) -> Region:
        """KV head g of sequence b (every sequence: None), positions krange (all: None); a pool
        is addressed through the page table, so a paged task declares the head's whole pool."""
        if self.page_table is not None:
            return box(self.k_cache, (g, g + 1), None, None, None)
        return box(self.k_cache, None if b is None else (b, b + 1), (g, g + 1), krange, None)

    def qkv_cols(self, g: int) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int]]:
        """Columns of KV group g's query heads, its key head and its value head in qkv."""
        D, G, QH, GS = self.head_dim, self.kv_heads, self.heads, self.group
        return ((g * GS * D, (g + 1) * GS * D), (QH * D + g * D, QH * D + (g + 1) * D),
                ((QH + G + g) * D, (QH + G + g + 1) * D))

    def norms(self) -> list[Region]:
        return [full(w) for w in (self.q_norm, self.k_norm) if w is not None]

    def tables(self) -> list[Region]:
        return [full(self.page_table)] if self.page_table is not None else []


@dataclass(frozen=True, slots=True)
class _KeySplits:
    """How one layer's attention is cut along the keys, and where the splits' partials go."""

    window: int  # keys of a sliding window; 0: global attention (the whole context)
    keys: int  # keys per split
    count: int  # splits per sequence and KV head
    part_o: Buffer  # [B, kv_heads, splits, group, head_dim] unnormalised partial outputs
    part_ml: Buffer  # [B, kv_heads, splits, group, (max, sum)] partial softmax stats


class _Lowerer:
    def __init__(self, spec: ModelSpec, opt: LowerOptions):
        if opt.fused_experts and spec.block != "parallel":
            raise SpecError(f"fused_experts: {spec.name} has a sequential block, whose MLP output goes to "
                            f"RESIDUAL tiles, not to the O-projection: expected fused_experts off")
        if opt.attention_sms and spec.block != "parallel":
            raise SpecError(f"--attention-sms {opt.attention_sms}: {spec.name} has a sequential block, whose "
                            f"attention and MLP do not run side by side: expected 0")
        self.spec, self.opt = spec, opt
        self.buffers: dict[str, Buffer] = {}
        self.tasks: list[Task] = []
        self.page_table: Buffer | None = None  # set by lower() when the KV cache is paged

    # -- helpers -------------------------------------------------------------------------------
    def buf(self, name: str, shape: tuple[int, ...], dtype: str, kind: str, doc: str = "") -> Buffer:
        b = Buffer(name, tuple(shape), dtype, kind, doc)
        self.buffers[name] = b
        return b

    def matrix(self, name: str, shape: tuple[int, ...], doc: str) -> Buffer:
        """A weight matrix a GEMV streams, stored in the weight format (LowerOptions.weights)."""
        return self.buf(name, shape, "fp8" if is_fp8(self.opt.weights) else "bf16", "weight", doc)

    @property
    def elem_bytes(self) -> int:
        """Bytes of one element of a GEMV's weight matrix."""
        return 1 if is_fp8(self.opt.weights) else 2

    def matrix_bytes(self, rows: int, k: int) -> int:
        """Bytes a GEMV reads of ``rows`` x ``k`` of one weight matrix, its scales included."""
        return rows * k * self.elem_bytes + scale_bytes(self.opt.weights, rows, k)

    def emit(self, op: Opcode, layer: int, name: str, operands: dict[str, Buffer | None],
             args: dict[str, int], reads: list[Region], writes: list[Region], flops: int = 0,
             act_bytes: int | None = None, weight_bytes: int | None = None) -> Task:
        """Append a task. Costs come from the regions unless a region is a conservative bound
        (a dynamic position or routing): then ``act_bytes`` gives the bytes really moved."""
        info = OP_INFO[op]
        ops = tuple(operands[r].name if operands.get(r) is not None else "-" for r in info.operands)
        assert set(args) == set(info.args), (op, set(args) ^ set(info.args))
        wbytes = weight_bytes if weight_bytes is not None else sum(self.region_bytes(r) for r in reads
                                                                 if self.buffers[r.buffer].kind == "weight")
        abytes = act_bytes if act_bytes is not None else sum(r.numel * DTYPE_BYTES[self.buffers[r.buffer].dtype] for r in (*reads, *writes)
                     if self.buffers[r.buffer].kind != "weight")
        t = Task(id=len(self.tasks), op=op, layer=layer, name=name, operands=ops,
                 args=tuple(int(args[a]) for a in info.args), reads=tuple(reads), writes=tuple(writes),
                 weight_bytes=wbytes, act_bytes=abytes, flops=flops)
        self.tasks.append(t)
        return t

    def region_bytes(self, r: Region) -> int:
        """Bytes of a weight region, an FP8 matrix's scales over its rows and columns included."""
        b = self.buffers[r.buffer]
        if b.dtype != "fp8":
            return r.numel * DTYPE_BYTES[b.dtype]
        (r0, r1), (k0, k1) = r.box[-2:]
        return r.numel + r.numel // ((r1 - r0) * (k1 - k0)) * scale_bytes(self.opt.weights, r1 - r0, k1 - k0)

    def attention_sms(self, global_attention: bool = False) -> int:
        """SMs' worth of attention splits in one layer (a parallel block only: __init__); a layer
        of global attention may have its own count (LowerOptions.global_attention_sms)."""
        if global_attention and self.opt.global_attention_sms:
            return self.opt.global_attention_sms
        return self.opt.attention_sms or self.opt.num_sms

    def mlp_sms(self, mlp_bytes: int) -> int:
        """Tiles of the MLP's first GEMV (dense SwiGLU or expert gate/up, ``mlp_bytes`` of weights in
        one layer): with attention SMs set apart, its share of the SMs by bytes against the QKV
        projection, which streams beside it before the splits can start; else every SM."""
        opt = self.opt
        if not opt.attention_sms:
            return opt.num_sms
        a = self.spec.attention
        qkv_bytes = (a.num_heads + 2 * a.num_kv_heads) * a.head_dim * self.spec.hidden_size * self.elem_bytes
        return max(1, min(opt.num_sms, round(opt.num_sms * mlp_bytes / (mlp_bytes + qkv_bytes))))

    def k_parts(self, k: int) -> list[tuple[int, int]]:
        """(k0, columns) of each part of a GEMV over ``k`` columns of a staged input: one part
        where they fit the shared memory (LowerOptions.max_gemv_k), else the K split's."""
        return k_splits(k, self.opt.max_gemv_k or gemv_max_k(self.opt.batch, self.spec.hidden_size))

    def mlp_down_parts(self, layer: int) -> list[tuple[int, int]]:
        """The K split of the layer's MLP down projection (one part: not split; fused expert tiles
        split it themselves)."""
        s = self.spec
        if s.layers[layer].mlp == "dense":
            return self.k_parts(s.dense_intermediate)
        return [(0, s.moe.intermediate)] if self.opt.fused_experts else self.k_parts(s.moe.intermediate)

    # -- ops -----------------------------------------------------------------------------------
    def linear(self, layer: int, label: str, x: Buffer | Normed, w: Buffer, out: Buffer, *, k0: int = 0,
               k: int | None = None, slab: int = 0, col0: int = 0, instances: int = 1,
               boundary: int | None = None, tile: int | None = None) -> None:
        """out[slab, :, col0 + r] = x[:, k0:k0+k] @ w[r, k0:k0+k]^T for every row r, tiled by rows."""
        rows = w.shape[0]
        k = k if k is not None else w.shape[1]
        B = self.opt.batch
        tile = tile or row_tile(rows, k * DTYPE_BYTES[w.dtype], instances, self.opt.num_sms, boundary)
        out_rank3 = len(out.shape) == 3
        xin, xreads = gemv_input(x, k0, k)
        for lo, hi in tiles(rows, tile):
            out_region = (box(out, (slab, slab + 1), None, (col0 + lo, col0 + hi)) if out_rank3
                          else box(out, None, (col0 + lo, col0 + hi)))
            self.emit(Opcode.LINEAR, layer, f"L{layer}.{label}[{lo}:{hi}]", {**xin, "weight": w, "out": out},
                      {"row0": lo, "rows": hi - lo, "k0": k0, "k": k, "col0": col0 + lo, "slab": slab},
                      [*xreads, box(w, (lo, hi), (k0, k0 + k))], [out_region],
                      flops=2 * B * (hi - lo) * k)

    def swiglu(self, layer: int, label: str, x: Buffer | Normed, w: Buffer, out: Buffer, inter: int) -> None:
        H, B = w.shape[1], self.opt.batch
        tile = row_tile(inter, 2 * H * DTYPE_BYTES[w.dtype], 1, self.mlp_sms(inter * 2 * H * DTYPE_BYTES[w.dtype]))
        xin, xreads = gemv_input(x)
        for lo, hi in tiles(inter, tile):
            self.emit(Opcode.SWIGLU, layer, f"L{layer}.{label}[{lo}:{hi}]", {**xin, "weight": w, "out": out},
                      {"row0": lo, "rows": hi - lo, "up_row0": inter + lo, "col0": lo},
                      [*xreads, box(w, (lo, hi), None), box(w, (inter + lo, inter + hi), None)],
                      [box(out, None, (lo, hi))], flops=4 * B * (hi - lo) * H)

    # -- the model ------------------------------------------------------------------------------
    def lower(self) -> Program:
        s, opt = self.spec, self.opt
        B, H, C = opt.batch, s.hidden_size, opt.context
        tokens = self.buf("tokens", (B,), "i32", "input", "[B] token ids of this step")
        positions = self.buf("positions", (B,), "i32", "input", "[B] position of this step's token")
        self.page_table = (self.buf("page_table", (B, pages_per_seq(C, opt.page_size)), "i32", "input",
                                    "[B, pages per sequence] KV page of each block of positions")
                           if opt.page_size else None)
        embed = self.buf("embed", (s.vocab_size, H), "bf16", "weight", "[vocab, hidden]")
        x = self.buf("L0.x", (B, H), "f32", "act", "[B, hidden] residual stream into layer 0")
        self.emit(Opcode.EMBED, -1, "embed", {"tokens": tokens, "embed": embed, "out": x}, {},
                  [full(tokens), full(embed)], [full(x)], weight_bytes=B * H * 2)
        for layer in range(s.num_layers):
            x = self.layer(layer, x, positions)
        L = s.num_layers
        fnw = self.buf("final_norm", (H,), "bf16", "weight", "[hidden]")
        xin, xreads = gemv_input(Normed(x, fnw))
        # an FP8 LM head is a copy of a tied embedding: the lookup reads bf16 rows
        tied = s.tie_word_embeddings and not is_fp8(opt.weights)
        head = embed if tied else self.matrix("lm_head", (s.vocab_size, H), "[vocab, hidden]")
        V = s.vocab_size
        tile = row_tile(V, H * self.elem_bytes, 1, opt.num_sms)
        ntiles = math.ceil(V / tile)
        logits = self.buf("logits", (B, V), "f32", "output", "[B, vocab] scaled logits")
        bval = self.buf("lm.best_val", (B, ntiles), "f32", "act", "[B, tiles] best logit per tile")
        bidx = self.buf("lm.best_idx", (B, ntiles), "i32", "act", "[B, tiles] its vocab index")
        for i, (lo, hi) in enumerate(tiles(V, tile)):
            self.emit(Opcode.LM_HEAD, L, f"lm_head[{lo}:{hi}]",
                      {**xin, "weight": head, "logits": logits, "best_val": bval, "best_idx": bidx},
                      {"row0": lo, "rows": hi - lo, "tile": i}, [*xreads, box(head, (lo, hi), None)],
                      [box(logits, None, (lo, hi)), box(bval, None, (i, i + 1)), box(bidx, None, (i, i + 1))],
                      flops=2 * B * (hi - lo) * H)
        nxt = self.buf("next_token", (B,), "i32", "output", "[B] greedy token")
        self.emit(Opcode.ARGMAX, L, "argmax", {"best_val": bval, "best_idx": bidx, "out": nxt},
                  {"tiles": ntiles}, [full(bval), full(bidx)], [full(nxt)])
        prog = Program(self.buffers, self.tasks, {"batch": B, "context": C, "num_sms": opt.num_sms,
                                                  "page_size": opt.page_size, "attention_sms": opt.attention_sms,
                                                  "rope_in_splits": opt.rope_in_splits,
                                                  "residual_in_o_proj": opt.residual_in_o_proj,
                                                  "fused_experts": opt.fused_experts, "weights": opt.weights})
        derive_edges(prog)
        return prog

    def layer(self, layer: int, x: Buffer, positions: Buffer) -> Buffer:
        """Lower one layer; returns the residual stream into the next one."""
        s, opt = self.spec, self.opt
        ls = s.layers[layer]
        B, H = opt.batch, s.hidden_size
        a = s.attention
        D, G, QH = a.head_dim, a.num_kv_heads, a.num_heads
        GS = QH // G
        P = f"L{layer}"
        nw = self.buf(f"{P}.attn_norm", (H,), "bf16", "weight", "[hidden]")
        n = Normed(x, nw)
        attn = self.attention(layer, n, positions)
        wo = self.matrix(f"{P}.w_o", (H, QH * D), "[hidden, heads * head_dim]")
        o_ends = opt.residual_in_o_proj
        # an MLP down projection split along k writes one partial per (routing slot,) part, summed
        # where the O-projection's are: after them in o_part (parallel block, residual tiles), else in
        # a buffer of their own that the residual tiles (or the O-projection tiles ending the layer) sum
        down_parts = self.mlp_down_parts(layer)
        n_down = 0 if len(down_parts) == 1 else len(down_parts) * (1 if ls.mlp == "dense" else s.moe.slots(B))
        shared = n_down and s.block == "parallel" and not o_ends
        o_part = None
        # O-proj split-K by KV group: slice g waits only for the attention of group g. Slices start
        # on whole 64-column blocks (the GEMV's): where a group's heads are narrower, a slice takes
        # the fewest groups that are (the last slice may end short of a block: it is padded)
        per = next((m for m in range(1, G) if m * GS * D % K_BLOCK == 0), G)
        o_slices = [(g, min(G, g + per)) for g in range(0, G, per)]
        if not o_ends:
            o_part = self.buf(f"{P}.o_part", (len(o_slices) + (n_down if shared else 0), B, H), "f32", "act",
                              "[kv group slices (then the MLP's split-K parts), B, hidden] split-K partials")
            o_tile = row_tile(H, per * GS * D * self.elem_bytes, len(o_slices), opt.num_sms)
            for i, (g0, g1) in enumerate(o_slices):
                label = f"o_proj[kv{g0}]" if per == 1 else f"o_proj[kv{g0}:{g1}]"
                self.linear(layer, label, attn, wo, o_part, k0=g0 * GS * D, k=(g1 - g0) * GS * D, slab=i,
                            tile=o_tile)
        # --- MLP on the same normed input (parallel block)
        mlp_in = n
        if s.block == "sequential":
            x_mid = self.buf(f"{P}.x_mid", (B, H), "f32", "act", "[B, hidden] x + attention")
            if o_ends:
                self.o_proj_residual(layer, attn, wo, x, x_mid)
            else:
                self.residual(layer, x, o_part, None, None, None, x_mid, "residual_attn")
            nw2 = self.buf(f"{P}.mlp_norm", (H,), "bf16", "weight", "[hidden]")
            mlp_in = Normed(x_mid, nw2)
            x, o_part = x_mid, None
        x_out = self.buf(f"L{layer + 1}.x", (B, H), "f32", "act", f"[B, hidden] residual stream into layer {layer + 1}")
        mo = routed = tslots = None
        parts = slab0 = None  # where the down projection's split-K partials go
        if n_down:
            parts, slab0 = (o_part, len(o_slices)) if shared else (self.buf(
                f"{P}.mlp_part", (n_down, B, H), "f32", "act",
                "[(slots x) k parts, B, hidden] split-K partials of the MLP's down projection"), 0)
        if ls.mlp == "dense":
            inter = s.dense_intermediate
            wgu = self.matrix(f"{P}.w_gate_up", (2 * inter, H), "[2 * inter (gate; up), hidden]")
            wd = self.matrix(f"{P}.w_down", (H, inter), "[hidden, inter]")
            h = self.buf(f"{P}.mlp_h", (B, inter), "bf16", "act", "[B, inter]")
            self.swiglu(layer, "gate_up", mlp_in, wgu, h, inter)
            if parts is None and o_ends and s.block == "sequential":
                # the down projection ends the layer as the O-projection ends its first half
                self.o_proj_residual(layer, h, wd, x, x_out, label="down")
                return x_out
            if parts is None:
                mo = self.buf(f"{P}.mlp_out", (1, B, H), "f32", "act", "[1, B, hidden]")
                self.linear(layer, "down", h, wd, mo)
            else:
                tile = row_tile(H, down_parts[0][1] * DTYPE_BYTES[wd.dtype], len(down_parts), opt.num_sms)
                for p, (k0, k) in enumerate(down_parts):
                    self.linear(layer, f"down[k{p}]", h, wd, parts, k0=k0, k=k, slab=slab0 + p, tile=tile)
        else:
            routed, tslots = self.moe(layer, mlp_in, down_parts, parts, slab0)
            if parts is not None:
                routed = tslots = None
        if o_ends and s.block == "parallel":  # the O-projection ends the layer, after the MLP in program order
            self.o_proj_residual(layer, attn, wo, x, x_out, mo, routed if parts is None else parts)
        else:
            self.residual(layer, x, o_part if parts is None else parts, mo, routed,
                          None if routed is None else tslots, x_out, "residual")
        return x_out


    def attention(self, layer: int, n: Normed, positions: Buffer) -> Buffer:
        """One layer's attention up to its output [B, heads * head_dim]: the QKV projection of the
        normed input, RoPE and the KV-cache append, the splits along the keys and their combine."""
        at = self.attention_operands(layer, n)
        fused = self.opt.rope_in_splits
        if not fused:  # appended before the splits read the cache
            for g in range(at.kv_heads):
                self.rope_append(layer, at, g, positions)
        splits = self.key_splits(layer)
        self.attention_splits(layer, at, splits, positions)
        if fused:  # after the splits: they take this step's k and v from qkv, not from the cache
            for g in range(at.kv_heads):
                self.rope_append(layer, at, g, positions)
        return self.attention_combine(layer, splits, positions)

    def attention_operands(self, layer: int, n: Normed) -> _AttentionOperands:
        """The QKV projection's tiles, and the buffers of the rotated queries, the KV cache and the
        qk-norm weights."""
        s, opt = self.spec, self.opt
        B, H, C = opt.batch, s.hidden_size, opt.context
        a = s.attention
        D, G, QH = a.head_dim, a.num_kv_heads, a.num_heads
        P = f"L{layer}"
        # QKV rows are [q heads..., k heads..., v heads...], D rows per head
        nqkv = (QH + 2 * G) * D
        wqkv = self.matrix(f"{P}.w_qkv", (nqkv, H), "[(heads + 2 kv_heads) * head_dim, hidden]")
        qkv = self.buf(f"{P}.qkv", (B, nqkv), "bf16", "act", "[B, (heads + 2 kv_heads) * head_dim]")
        self.linear(layer, "qkv", n, wqkv, qkv, boundary=D)
        fused = opt.rope_in_splits
        q = None if fused else self.buf(f"{P}.q", (B, QH * D), "bf16", "act",
                                        "[B, heads * head_dim] after RoPE")
        pt, psz = self.page_table, opt.page_size
        if pt is not None:  # a pool of pages per layer (mkc/ir/kv_layout.py)
            pool = (G, opt.kv_pages or B * pt.shape[1], psz, D)
            kc = self.buf(f"{P}.k_cache", pool, "bf16", "state", "[kv_heads, pages, page_size, head_dim]")
            vc = self.buf(f"{P}.v_cache", pool, "bf16", "state", "[kv_heads, pages, page_size, head_dim]")
        else:
            kc = self.buf(f"{P}.k_cache", (B, G, C, D), "bf16", "state", "[B, kv_heads, ctx, head_dim]")
            vc = self.buf(f"{P}.v_cache", (B, G, C, D), "bf16", "state", "[B, kv_heads, ctx, head_dim]")
        # qk-norm: per-head RMSNorm of q and k before RoPE, weights shared by every head
        qn = self.buf(f"{P}.q_norm", (D,), "bf16", "weight", "[head_dim]") if a.qk_norm else None
        kn = self.buf(f"{P}.k_norm", (D,), "bf16", "weight", "[head_dim]") if a.qk_norm else None
        return _AttentionOperands(qkv, q, kc, vc, pt, qn, kn, heads=QH, kv_heads=G, head_dim=D)

    def rope_append(self, layer: int, at: _AttentionOperands, g: int, positions: Buffer) -> None:
        """k (and, unless the splits rotate q, q) of KV group g rotated; k and v appended at the
        step's positions."""
        fused = at.q is None
        qkv, q, vc = at.qkv, at.q, at.v_cache
        qcols, kcols, vcols = at.qkv_cols(g)
        self.emit(Opcode.ROPE_APPEND, layer, f"L{layer}.rope_append[kv{g}]",
                  {"qkv": qkv, "positions": positions, "q": q, "k_cache": at.k_cache, "v_cache": vc,
                   "q_norm": at.q_norm, "k_norm": at.k_norm, "page_table": at.page_table},
                  {"kv_head": g, "rope": int(self.spec.layers[layer].rope)},
                  [*([] if fused else [box(qkv, None, qcols)]), box(qkv, None, kcols), box(qkv, None, vcols),
                   full(positions), *at.norms(), *at.tables()],
                  [*([] if fused else [box(q, None, qcols)]), at.head_rows(g),
                   Region(vc.name, at.head_rows(g).box)],
                  act_bytes=self.opt.batch * ((0 if fused else 2 * at.group) + 4) * at.head_dim * 2)

    def key_splits(self, layer: int) -> _KeySplits:
        """How many keys each attention split of the layer reads (its window, or the context), and
        the buffers of their partial outputs."""
        s, opt = self.spec, self.opt
        B, C = opt.batch, opt.context
        a = s.attention
        D, G, GS = a.head_dim, a.num_kv_heads, a.num_heads // a.num_kv_heads
        P = f"L{layer}"
        window = a.sliding_window if s.layers[layer].attention == "sliding" else 0
        keys = min(C, window) if window else C
        # a sliding window may straddle the bucket start, so it can touch one extra split's worth
        split_keys = attention_split_keys(keys, 2 * D * 2, B * G,
                                          self.attention_sms(global_attention=not window))
        nsplit = math.ceil(keys / split_keys)
        part_o = self.buf(f"{P}.attn_part_o", (B, G, nsplit, GS, D), "f32", "act",
                          "[B, kv_heads, splits, group, head_dim] unnormalised partial outputs")
        part_ml = self.buf(f"{P}.attn_part_ml", (B, G, nsplit, GS, 2), "f32", "act",
                           "[B, kv_heads, splits, group, (max, sum)] partial softmax stats")
        return _KeySplits(window, split_keys, nsplit, part_o, part_ml)

    def attention_splits(self, layer: int, at: _AttentionOperands, sp: _KeySplits, positions: Buffer) -> None:
        """The ATTN_SPLIT tasks: per sequence, KV head and range of keys, a partial softmax(q k) v."""
        C = self.opt.context
        D, GS = at.head_dim, at.group
        fused = at.q is None
        qkv, q, kc, vc = at.qkv, at.q, at.k_cache, at.v_cache
        window, split_keys = sp.window, sp.keys
        for b in range(self.opt.batch):
            for g in range(at.kv_heads):
                qcols, kcols, vcols = at.qkv_cols(g)
                # fused: the query heads, and this step's key and value (for the split holding the
                # position), come from qkv; unfused: the rotated q
                query = ([box(qkv, (b, b + 1), qcols), box(qkv, (b, b + 1), kcols),
                          box(qkv, (b, b + 1), vcols), *at.norms()] if fused else [box(q, (b, b + 1), qcols)])
                for s in range(sp.count):
                    # global layers read a fixed key range; sliding windows move with the position
                    krange = (s * split_keys, min(C, (s + 1) * split_keys)) if not window else None
                    kv_rows = at.head_rows(g, b, krange)
                    self.emit(Opcode.ATTN_SPLIT, layer, f"L{layer}.attn[b{b},kv{g},s{s}]",
                              {"q": q, "k_cache": kc, "v_cache": vc, "positions": positions,
                               "part_o": sp.part_o, "part_ml": sp.part_ml, "page_table": at.page_table,
                               "qkv": qkv if fused else None, "q_norm": at.q_norm if fused else None,
                               "k_norm": at.k_norm if fused else None},
                              {"seq": b, "kv_head": g, "split": s, "split_keys": split_keys, "window": window,
                               "rope": int(self.spec.layers[layer].rope)},
                              [*query, kv_rows, Region(vc.name, kv_rows.box), full(positions), *at.tables()],
                              [box(sp.part_o, (b, b + 1), (g, g + 1), (s, s + 1), None, None),
                               box(sp.part_ml, (b, b + 1), (g, g + 1), (s, s + 1), None, None)],
                              flops=4 * GS * D * split_keys, act_bytes=2 * split_keys * D * 2)

    def attention_combine(self, layer: int, sp: _KeySplits, positions: Buffer) -> Buffer:
        """The ATTN_COMBINE tasks: the splits' partials merged into the attention output
        [B, heads * head_dim]."""
        B, a = self.opt.batch, self.spec.attention
        D, G, QH = a.head_dim, a.num_kv_heads, a.num_heads
        GS = QH // G
        P = f"L{layer}"
        attn = self.buf(f"{P}.attn", (B, QH * D), "bf16", "act", "[B, heads * head_dim] attention output")
        # the merge of a group is spread over several tasks of a few query heads each (each reads
        # only its heads' partials)
        hpc = combine_heads(GS)
        for g in range(G):
            for h in range(0, GS, hpc):
                head = g * GS + h
                self.emit(Opcode.ATTN_COMBINE, layer, f"{P}.combine[kv{g},h{head}:{head + hpc}]",
                          {"part_o": sp.part_o, "part_ml": sp.part_ml, "positions": positions, "out": attn},
                          {"kv_head": g, "head0": h, "heads": hpc, "splits": sp.count, "split_keys": sp.keys,
                           "window": sp.window},
                          [box(sp.part_o, None, (g, g + 1), None, (h, h + hpc), None),
                           box(sp.part_ml, None, (g, g + 1), None, (h, h + hpc), None), full(positions)],
                          [box(attn, None, (head * D, (head + hpc) * D))])
        return attn

    def o_proj_residual(self, layer: int, attn: Buffer, wo: Buffer, x: Buffer, out: Buffer,
                        mlp: Buffer | None = None, routed: Buffer | None = None, label: str = "o_proj") -> None:
        """out[:, rows] = x + attn @ wo[rows]^T (+ mlp) (+ every routing slot's output), tiled by
        rows (LowerOptions.residual_in_o_proj); in a sequential block the dense MLP's down
        projection ends the layer the same way (``label`` "down", ``attn`` its input)."""
        H, k = wo.shape
        tile = row_tile(H, k * DTYPE_BYTES[wo.dtype], 1, self.opt.num_sms)
        B = self.opt.batch
        for lo, hi in tiles(H, tile):
            cols = (lo, hi)
            reads = [full(attn), box(wo, cols, None), box(x, None, cols)]
            reads += [box(b, None, None, cols) for b in (mlp, routed) if b is not None]
            self.emit(Opcode.LINEAR, layer, f"L{layer}.{label}[{lo}:{hi}]",
                      {"x": attn, "norm": None, "weight": wo, "out": out, "residual": x, "mlp": mlp, "routed": routed},
                      {"row0": lo, "rows": hi - lo, "k0": 0, "k": k, "col0": lo, "slab": 0},
                      reads, [box(out, None, cols)], flops=2 * B * (hi - lo) * k)

    def moe(self, layer: int, n: Normed, down_parts: list[tuple[int, int]], parts: Buffer | None = None,
            slab0: int = 0) -> tuple[Buffer, Buffer]:
        """The routed experts of one layer: (their weighted outputs [slots, B, hidden], each
        token's slots [B, top_k]). With more than one of ``down_parts`` (the K split of the down
        projection) the down tiles write slot j's part p to ``parts[slab0 + j * len(down_parts) + p]``
        instead, and the first buffer returned is ``parts``."""
        s, opt = self.spec, self.opt
        m = s.moe
        assert m is not None
        B, H, E, K, I = opt.batch, s.hidden_size, m.num_experts, m.top_k, m.intermediate
        P = f"L{layer}"
        slots = m.slots(B)
        wr = self.buf(f"{P}.w_router", (E, H), "bf16", "weight", "[experts, hidden]")
        rl = self.buf(f"{P}.router_logits", (B, E), "f32", "act", "[B, experts]")
        self.linear(layer, "router", n, wr, rl)
        # the expert tiles derive their expert from the logits themselves; the token slots are for
        # the residual tiles, which run tens of µs later
        tslots = self.buf(f"{P}.moe_token_slots", (B, K), "i32", "act", "[B, top_k] slot of each token's experts")
        selected = self.buf(f"{P}.moe_selected", (B, K), "i32", "output", "[B, top_k] each token's experts, best first")
        self.emit(Opcode.TOPK, layer, f"{P}.topk",
                  {"logits": rl, "token_slots": tslots, "selected": selected},
                  {}, [full(rl)], [full(tslots), full(selected)])
        wgu = self.matrix(f"{P}.w_experts_gate_up", (E, 2 * I, H), "[experts, 2 * inter (gate; up), hidden]")
        wd = self.matrix(f"{P}.w_experts_down", (E, H, I), "[experts, hidden, inter]")
        if opt.fused_experts:
            return self.fused_experts(layer, n, rl, wgu, wd, slots), tslots
        h = self.buf(f"{P}.moe_h", (slots, B, I), "bf16", "act", "[slots, B, inter]")
        split = len(down_parts) > 1
        out = parts if split else self.buf(f"{P}.moe_out", (slots, B, H), "f32", "act",
                                           "[slots, B, hidden] weighted expert outputs")
        up_tile = row_tile(I, 2 * H * self.elem_bytes, slots, self.mlp_sms(slots * I * 2 * H * self.elem_bytes))
        xin, xreads = gemv_input(n)
        kd = down_parts[0][1]
        down_tile = min(opt.expert_down_rows, H) or row_tile(H, kd * self.elem_bytes, slots * len(down_parts), opt.num_sms)
        up_ranges = tiles(I, up_tile)
        if opt.expert_up_rows:
            if sum(opt.expert_up_rows) != I:
                raise SpecError(f"expert_up_rows = {tuple(opt.expert_up_rows)} add up to {sum(opt.expert_up_rows)} "
                                f"rows: expected the expert intermediate size, {I}")
            ends = list(itertools.accumulate(opt.expert_up_rows))
            up_ranges = list(zip([0, *ends[:-1]], ends))
        for j in range(slots):
            for lo, hi in up_ranges:
                # which expert is read is known only at run time: declare every expert's rows,
                # and count the bytes of one expert
                self.emit(Opcode.EXPERT_SWIGLU, layer, f"{P}.expert_up[slot{j}][{lo}:{hi}]",
                          {**xin, "weight": wgu, "logits": rl, "out": h},
                          {"slot": j, "row0": lo, "rows": hi - lo},
                          [*xreads, full(rl), box(wgu, None, (lo, hi), None),
                           box(wgu, None, (I + lo, I + hi), None)],
                          [box(h, (j, j + 1), None, (lo, hi))], flops=4 * B * (hi - lo) * H,
                          weight_bytes=2 * self.matrix_bytes(hi - lo, H))
        for j in range(slots):
            if not split:
                for lo, hi in tiles(H, down_tile):
                    self.emit(Opcode.EXPERT_DOWN, layer, f"{P}.expert_down[slot{j}][{lo}:{hi}]",
                              {"h": h, "weight": wd, "logits": rl, "out": out},
                              {"slot": j, "row0": lo, "rows": hi - lo},
                              [box(h, (j, j + 1), None, None), full(rl), box(wd, None, (lo, hi), None)],
                              [box(out, (j, j + 1), None, (lo, hi))], flops=2 * B * (hi - lo) * I,
                              weight_bytes=self.matrix_bytes(hi - lo, I))
                continue
            for p, (k0, k) in enumerate(down_parts):  # the K split: one partial per part
                slab = slab0 + j * len(down_parts) + p
                for lo, hi in tiles(H, down_tile):
                    self.emit(Opcode.EXPERT_DOWN_SPLIT, layer, f"{P}.expert_down[slot{j}][{lo}:{hi}][k{p}]",
                              {"h": h, "weight": wd, "logits": rl, "out": out},
                              {"slot": j, "row0": lo, "rows": hi - lo, "k0": k0, "k": k, "slab": slab},
                              [box(h, (j, j + 1), None, (k0, k0 + k)), full(rl), box(wd, None, (lo, hi), (k0, k0 + k))],
                              [box(out, (slab, slab + 1), None, (lo, hi))], flops=2 * B * (hi - lo) * k,
                              weight_bytes=self.matrix_bytes(hi - lo, k))
        return out, tslots

    def fused_experts(self, layer: int, n: Normed, rl: Buffer, wgu: Buffer, wd: Buffer, slots: int) -> Buffer:
        """EXPERT_MLP tiles (LowerOptions.fused_experts): tile (slot j, rows [lo, hi)) of the expert's
        intermediate rows computes them and their share of the down projection; returns the
        partials [slots * parts, B, hidden] (part p of slot j at row j * parts + p). The rows per
        tile are a multiple of 64, the GEMV's reduction block, since they are the down projection's
        k."""
        opt = self.opt
        B, H, I = opt.batch, self.spec.hidden_size, self.spec.moe.intermediate
        P = f"L{layer}"
        if I % 64:
            raise SpecError(f"fused_experts: the expert intermediate size {I} is the down projection's reduction, "
                            f"which the GEMV reads in blocks of 64: expected a multiple of 64, or fused_experts off")
        row_bytes = 3 * H * 2  # gate, up and down
        tile = row_tile(I, row_bytes, slots, self.mlp_sms(slots * I * row_bytes))
        tile = min(I, -(-tile // 64) * 64)
        while I % tile:  # equal parts: every partial covers the same rows
            tile += 64
        parts = I // tile
        out = self.buf(f"{P}.moe_out", (slots * parts, B, H), "f32", "act",
                       "[slots * parts, B, hidden] weighted split-K partials of the expert outputs")
        xin, xreads = gemv_input(n)
        for j in range(slots):
            for part, (lo, hi) in enumerate(tiles(I, tile)):
                self.emit(Opcode.EXPERT_MLP, layer, f"{P}.expert_mlp[slot{j}][{lo}:{hi}]",
                          {**xin, "weight": wgu, "down": wd, "logits": rl, "out": out},
                          {"slot": j, "row0": lo, "rows": hi - lo, "part": part},
                          [*xreads, full(rl), box(wgu, None, (lo, hi), None), box(wgu, None, (I + lo, I + hi), None),
                           box(wd, None, None, (lo, hi))],
                          [box(out, (j * parts + part, j * parts + part + 1), None, None)],
                          flops=6 * B * (hi - lo) * H, weight_bytes=3 * (hi - lo) * H * 2)
        return out

    def residual(self, layer: int, x: Buffer, o_part: Buffer | None, mlp: Buffer | None,
                 routed: Buffer | None, tslots: Buffer | None, out: Buffer, label: str) -> None:
        H = self.spec.hidden_size
        tile = row_tile(H, 1024, 1, self.opt.num_sms)
        for lo, hi in tiles(H, tile):
            reads = [box(x, None, (lo, hi))]
            if o_part is not None:
                reads.append(box(o_part, None, None, (lo, hi)))
            if mlp is not None:
                reads.append(box(mlp, None, None, (lo, hi)))
            if routed is not None:
                reads += [box(routed, None, None, (lo, hi)), full(tslots)]
            self.emit(Opcode.RESIDUAL, layer, f"L{layer}.{label}[{lo}:{hi}]",
                      {"x": x, "o_part": o_part, "mlp": mlp, "routed": routed, "token_slots": tslots, "out": out},
                      {"col0": lo, "cols": hi - lo, "o_parts": o_part.shape[0] if o_part is not None else 0},
                      reads, [box(out, None, (lo, hi))],
                      act_bytes=self.opt.batch * (hi - lo) * 4 * (2 + (o_part.shape[0] if o_part is not None else 0)
                                                               + (tslots.shape[1] if tslots is not None else 1)))


def lower(spec: ModelSpec, batch: int, context: int, num_sms: int, page_size: int = 0, kv_pages: int = 0,
          attention_sms: int = 0, **choices) -> Program:
    """Lower a model into a Program (buffers, tasks in program order, derived DAG). ``choices``: the
    other LowerOptions fields (rope_in_splits, residual_in_o_proj, ...)."""
    opt = LowerOptions(batch=batch, context=context, num_sms=num_sms, page_size=page_size, kv_pages=kv_pages,
                       attention_sms=attention_sms, **choices)
    opt = dataclasses.replace(opt, expert_up_rows=tuple(opt.expert_up_rows))  # a list from JSON or a CLI
    opt.check()
    if opt.expert_up_rows and spec.moe is None:
        raise SpecError(f"expert_up_rows = {opt.expert_up_rows}: {spec.name} has no routed experts")
    return _Lowerer(spec, opt).lower()
