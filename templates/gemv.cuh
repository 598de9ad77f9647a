// Batch <= 8 GEMV tiles on the tensor cores ("swap-AB"): weights are the A operand (16 rows per
// mma), the tokens the B operand (n = 8 columns; tokens >= BATCH are zero), fp32 accumulation.
//
// The reduction dimension k is permuted so that every lane loads its A fragment with 16-byte
// vector loads straight from global memory: lane (g = lane / 4, q = lane % 4) loads elements
// [64 kb + 8 q, +8) and [64 kb + 32 + 8 q, +8) of rows g and g + 8, so each load instruction
// reads whole 64-byte runs of 8 rows (full 32-byte sectors); mma step s of the block feeds it
// words 2s (logical k 2q, 2q+1) and 2s+1 (logical k 2q+8, 2q+9) of those 16 elements. The B
// fragment (the activations, staged in shared memory) uses the same permutation, so the dot
// products are exact sums over all k in a different order. Weights are read either in their
// checkpoint layout [rows, k] or, with WEIGHTS_TILED, in tile order (mkc/codegen/weight_tiles.py:
// the same pieces stored where each of a warp's loads reads 512 contiguous bytes); the products
// and their order are the same in both.
//
// FP8 weights (WEIGHT_FORMAT > 0, tile order only): a block of 16 rows x 64 columns is 1024 bytes,
// row half j (rows g + 8 j) of lane l at byte j * 512 + 16 l: the 8 elements of piece 2 j of the
// bf16 order, then those of piece 2 j + 1. A lane's two 16-byte loads per block become the four
// bf16 pieces in registers (e4m3x4_to_bf16), so the products are those of the dequantised weights;
// a scale per row multiplies a row's sums at the end, a scale per 128 x 128 block each block's.
// gemv_tile takes them with its `finish` (WithScales); bf16 tiles compile to the same code as
// before FP8 existed.
//
// Work split: a tile of `rows` rows is 16-row groups (one per warp item); when there are fewer
// groups than warps, k is split over up to ks warps and reduced through shared memory in a fixed
// order (deterministic).
#pragma once

__device__ __forceinline__ void mma_16816(float (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Shared-memory row stride of the staged activations, in elements: the 64-byte pad puts rows g
// and g + 1 in opposite halves of the 128-byte bank window, so each quarter-warp's B-fragment
// loads (lanes of two rows, 64 contiguous bytes each) are conflict-free.
constexpr int XS_PAD = 32;
__device__ __forceinline__ int xs_ld(int k) { return k + XS_PAD; }

// A GEMV's reduction k in whole 64-wide blocks (K_PADDED): the staged input's columns [k, pad_k(k))
// are zeros (stage_pad_zeros), so the weights' columns there add nothing.
__device__ __forceinline__ int pad_k(int k) { return K_PADDED ? (k + 63) & ~63 : k; }

// The zeros of the staged input's columns [k, pad_k(k)) (K_PADDED): fewer than 8 pieces of 16 bytes
// in each of its 8 rows, one per thread. gemv_tile stores them before its first weight loads (in
// the staging, which overlaps those loads, they cost registers), and its `finish` publishes them.
__device__ __forceinline__ void stage_pad_zeros(bf16* xs, int k) {
    if constexpr (K_PADDED) {
        const int pieces = (pad_k(k) - k) / 8, i = threadIdx.x;
        if (i < 8 * pieces) *reinterpret_cast<uint4*>(xs + (i / pieces) * xs_ld(pad_k(k)) + k + (i % pieces) * 8) = zero4();
    }
}

// The k-split reduction's floats: per warp, two row sets' fragments.
constexpr int GEMV_RED_FLOATS = NUM_WARPS * 2 * 4 * 32;

// Where a lane's A-fragment pieces are. Row-major (the checkpoint's layout, and the KV cache):
// w0 / w1 point at rows g / g + 8 of the group, column 8 q; block kb starts 64 elements further,
// its second 32 columns 32 further. Tile order (WEIGHTS_TILED, for weights: weight_tiles.py): the
// group's blocks are 1024 elements each, a lane's pieces 256 apart, rows g + 8 at + 512.
template <bool NC>
__host__ __device__ constexpr bool tiled_rows() { return NC && WEIGHTS_TILED; }
template <bool NC>
__host__ __device__ constexpr int block_stride() { return tiled_rows<NC>() ? 1024 : 64; }
template <bool NC>
__host__ __device__ constexpr int half_offset() { return tiled_rows<NC>() ? 256 : 32; }

// This lane's pointers into 16-row group gi of each row set w[a] (row 0, column 0 of the tile;
// row stride w_ld elements).
template <int NACC, bool NC>
__device__ __forceinline__ void group_rows(const bf16* const (&w)[NACC], int w_ld, int gi, const bf16* (&w0)[NACC],
                                           const bf16* (&w1)[NACC]) {
    const int lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
#pragma unroll
    for (int a = 0; a < NACC; ++a) {
        if constexpr (tiled_rows<NC>()) {
            w0[a] = w[a] + (size_t)gi * 16 * w_ld + lane * 8;
            w1[a] = w0[a] + 512;
        } else {
            w0[a] = w[a] + (size_t)(gi * 16 + g) * w_ld + q * 8;
            w1[a] = w0[a] + (size_t)8 * w_ld;
        }
    }
}

// Stage x[:, k0:k0+k] (bf16 [nrows, x_ld]) into shared memory as the 8 columns of the B operand
// (columns >= nrows zero): the tokens of a GEMV, or the query heads of an attention tile. One warp
// per row, its lanes over the row's 16-byte pieces, as stage_x_async below.
__device__ __forceinline__ void stage_x(bf16* xs, const bf16* x, int x_ld, int k0, int k, int nrows = BATCH) {
    const int ld = xs_ld(k), chunks = k / 8, lane = threadIdx.x % 32;
#pragma unroll 1
    for (int n = threadIdx.x / 32; n < 8; n += NUM_WARPS) {
        bf16* row = xs + n * ld;
        const bf16* src = x + (size_t)n * x_ld + k0;
        for (int c = lane; c < chunks; c += 32)
            *reinterpret_cast<uint4*>(row + c * 8) = n < nrows ? ld_act16(src + c * 8) : zero4();
    }
}

// Stage the RMSNorm of the f32 residual stream x [BATCH, HIDDEN] with weight w, columns
// [k0, k0 + k), as stage_x would stage the normed activations: xn = bf16(x * r * w) with
// r = rsqrt(mean(x^2) + eps). stage_norm_async copies the rows and the weight columns into
// `scratch` (NORM_SCRATCH_BYTES of shared memory: x, then the weight) with cp.async. Once every
// thread has waited for its own copies (StageFinish does), stage_norm_finish publishes them with a
// barrier; then one warp per token sums the squares quad by quad per lane and across the warp in a
// fixed order (every consumer of a norm stages the same values) and scales its columns into xs
// (rows >= BATCH zero). A barrier must follow before xs is read.
constexpr int NORM_QUADS = HIDDEN / 4;
constexpr int NORM_SCRATCH_BYTES = BATCH * HIDDEN * 4 + HIDDEN * 2;
static_assert(HIDDEN % 8 == 0, "RMSNorm staging copies 16-byte pieces of the weight");
// The copies are spread over the CTA's threads from warp first_warp on (0: all of them).
__device__ __forceinline__ void stage_norm_async(const float* x, const bf16* w, int k0, int k, unsigned char* scratch,
                                                 int first_warp = 0) {
    float4* xq = reinterpret_cast<float4*>(scratch);                    // [BATCH][NORM_QUADS]
    bf16* ws = reinterpret_cast<bf16*>(scratch + BATCH * HIDDEN * 4);  // [HIDDEN], columns [k0, k0 + k)
    const int me = threadIdx.x - 32 * first_warp, lanes = NUM_THREADS - 32 * first_warp;
    for (int i = me; i < BATCH * NORM_QUADS; i += lanes) cp_async16(xq + i, reinterpret_cast<const float4*>(x) + i);
    for (int c = me; c < k / 8; c += lanes) cp_async16(ws + k0 + 8 * c, w + k0 + 8 * c);
}

// With first_warp > 0 only warps first_warp.. take part (their copies: stage_norm_async's
// first_warp), meeting at a barrier of their own (warps_barrier), one warp per token from there.
__device__ __forceinline__ void stage_norm_finish(bf16* xs, int k0, int k, unsigned char* scratch, int first_warp = 0) {
    const float4* xq = reinterpret_cast<const float4*>(scratch);
    const uint2* wq = reinterpret_cast<const uint2*>(scratch + BATCH * HIDDEN * 4);
    warps_barrier(first_warp);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, ld = xs_ld(pad_k(k)), q0 = k0 / 4, nq = k / 4;
#pragma unroll 1
    for (int n = warp - first_warp; n < 8; n += NUM_WARPS - first_warp) {
        bf16* row = xs + n * ld;
        if (n >= BATCH) {
            for (int c = lane; c < k / 8; c += 32) *reinterpret_cast<uint4*>(row + c * 8) = zero4();
            continue;
        }
        const float4* xr = xq + n * NORM_QUADS;
        float ss = 0.f;
#pragma unroll 1
        for (int c = lane; c < NORM_QUADS; c += 32) {
            const float4 u = xr[c];
            ss += u.x * u.x + u.y * u.y + u.z * u.z + u.w * u.w;
        }
        const float r = rsqrtf(warp_sum(ss) / (float)HIDDEN + NORM_EPS);
#pragma unroll 1
        for (int c = q0 + lane; c < q0 + nq; c += 32) {
            const float4 u = xr[c];
            const uint2 wv = wq[c];
            uint2 o;
            o.x = pack_bf16x2(u.x * r * bf_lo(wv.x), u.y * r * bf_hi(wv.x));
            o.y = pack_bf16x2(u.z * r * bf_lo(wv.y), u.w * r * bf_hi(wv.y));
            *reinterpret_cast<uint2*>(row + 4 * (c - q0)) = o;
        }
    }
}

// stage_x with cp.async (16-byte copies straight into the tile; rows >= nrows zeroed by stores):
// completes at the issuing thread's cp.async wait, published by a barrier (WaitCopyFinish in
// ops.cuh). One warp per token row, its lanes over the row's pieces: a row's copies or zero stores
// are one plain loop with no index arithmetic per piece, so the copies are issued soon.
__device__ __forceinline__ void stage_x_async(bf16* xs, const bf16* x, int x_ld, int k0, int k, int nrows = BATCH) {
    const int ld = xs_ld(pad_k(k)), chunks = k / 8, lane = threadIdx.x % 32;
#pragma unroll 1
    for (int n = threadIdx.x / 32; n < 8; n += NUM_WARPS) {
        bf16* row = xs + n * ld;
        if (n < nrows) {
            const bf16* src = x + (size_t)n * x_ld + k0;
#pragma unroll 4
            for (int c = lane; c < chunks; c += 32) cp_async16(row + c * 8, src + c * 8);
        } else {
#pragma unroll 4
            for (int c = lane; c < chunks; c += 32) *reinterpret_cast<uint4*>(row + c * 8) = zero4();
        }
    }
}

// A-operand rows: immutable weights take the non-coherent streaming path (NC); rows written
// earlier in this launch (the KV cache) take the coherent L2 path.
template <bool NC>
__device__ __forceinline__ uint4 ld_rows16(const bf16* p) {
    if constexpr (NC) return ldg_stream(p);
    else return ld_act16(p);
}

// Loads of one batch of U 64-wide blocks (kb, kb + kb_step, ...) of rows (g, g + 8) of every row
// set; blocks past kb_end (or rows past the tile) load zeros without touching memory.
template <int U, int NACC, bool NC>
__device__ __forceinline__ void gemv_load(uint4 (&wv)[U][NACC][2][2], const bf16* const (&w0)[NACC],
                                          const bf16* const (&w1)[NACC], bool v0, bool v1, int kb, int kb_step,
                                          int kb_end) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
        const int kbu = kb + u * kb_step;
        const bool in = kbu < kb_end;
        const int k = kbu * block_stride<NC>(), h = half_offset<NC>();
#pragma unroll
        for (int a = 0; a < NACC; ++a) {
            wv[u][a][0][0] = (in && v0) ? ld_rows16<NC>(w0[a] + k) : zero4();
            wv[u][a][0][1] = (in && v0) ? ld_rows16<NC>(w0[a] + k + h) : zero4();
            wv[u][a][1][0] = (in && v1) ? ld_rows16<NC>(w1[a] + k) : zero4();
            wv[u][a][1][1] = (in && v1) ? ld_rows16<NC>(w1[a] + k + h) : zero4();
        }
    }
}

// The four MMAs of one 64-wide block of one row set: pieces l0, l1 (row g) and h0, h1 (row g + 8)
// of the A fragment, the block's activations xw (the file comment has the k permutation).
__device__ __forceinline__ void mma_block(float (&acc)[4], const uint4& l0, const uint4& l1, const uint4& h0,
                                          const uint4& h1, const u32 (&xw)[8]) {
    const u32 lo[8] = {l0.x, l0.y, l0.z, l0.w, l1.x, l1.y, l1.z, l1.w};
    const u32 hi[8] = {h0.x, h0.y, h0.z, h0.w, h1.x, h1.y, h1.z, h1.w};
#pragma unroll
    for (int s = 0; s < 4; ++s) mma_16816(acc, lo[2 * s], hi[2 * s], lo[2 * s + 1], hi[2 * s + 1], xw[2 * s], xw[2 * s + 1]);
}

// The tensor-core work of one loaded batch.
template <int U, int NACC>
__device__ __forceinline__ void gemv_mma(const uint4 (&wv)[U][NACC][2][2], const bf16* xrow, int kb, int kb_step,
                                         int kb_end, float (&acc)[NACC][4]) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
        const int kbu = kb + u * kb_step;
        if (kbu < kb_end) {
            const int k = kbu * 64;
            const uint4 xa = lds16(xrow + k), xb = lds16(xrow + k + 32);
            const u32 xw[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
#pragma unroll
            for (int a = 0; a < NACC; ++a) mma_block(acc[a], wv[u][a][0][0], wv[u][a][0][1], wv[u][a][1][0], wv[u][a][1][1], xw);
        }
    }
}

// 64-wide blocks per register batch of a warp item with NACC row sets (two batches are in flight).
template <int NACC>
__host__ __device__ constexpr int gemv_batch_blocks() { return GEMV_UNROLL / NACC / 2 > 0 ? GEMV_UNROLL / NACC / 2 : 1; }

extern __shared__ __align__(128) unsigned char gemv_dyn_smem[];  // the kernel's dynamic shared memory

// Accumulate one warp item: rows (g, g + 8) of each of the NACC weight row sets over the blocks
// kb_begin, kb_begin + kb_step, ... < kb_end (64 elements each). Software-pipelined over two
// register batches of U blocks: the loads of one batch are in flight while the other is
// multiplied, so the stream never drains between batches.
// With `first`, the tile's `finish` (the end of the activations' staging, see gemv_tile; for tiles
// that issue their weights before their wait, the wait too) runs once the first batch's loads are
// issued, so their round trips overlap.
template <int NACC, bool NC = true, class Fin>
__device__ __forceinline__ void gemv_item(const bf16* const (&w0)[NACC],
                                          const bf16* const (&w1)[NACC], bool v0, bool v1, const bf16* xrow,
                                          int kb_begin, int kb_step, int kb_end, float (&acc)[NACC][4],
                                          const Fin& finish, bool first) {
    constexpr int U = gemv_batch_blocks<NACC>();
    const int batch = U * kb_step;
    uint4 wa[U][NACC][2][2], wb[U][NACC][2][2];
    gemv_load<U, NACC, NC>(wa, w0, w1, v0, v1, kb_begin, kb_step, kb_end);
    if (first) finish();
    for (int kb = kb_begin; kb < kb_end; kb += 2 * batch) {
        gemv_load<U, NACC, NC>(wb, w0, w1, v0, v1, kb + batch, kb_step, kb_end);
        gemv_mma<U, NACC>(wa, xrow, kb, kb_step, kb_end, acc);
        if (kb + batch >= kb_end) break;
        gemv_load<U, NACC, NC>(wa, w0, w1, v0, v1, kb + 2 * batch, kb_step, kb_end);
        gemv_mma<U, NACC>(wb, xrow, kb + batch, kb_step, kb_end, acc);
    }
}

// ---- FP8 weights ---------------------------------------------------------------------------------

// This lane's pointers into 16-row group gi of each FP8 row set (tile order: 16 bytes per lane and
// row half).
template <int NACC>
__device__ __forceinline__ void group_rows_fp8(const fp8e4* const (&w)[NACC], int w_ld, int gi,
                                               const fp8e4* (&w0)[NACC], const fp8e4* (&w1)[NACC]) {
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int a = 0; a < NACC; ++a) {
        w0[a] = w[a] + (size_t)gi * 16 * w_ld + lane * 16;
        w1[a] = w0[a] + 512;
    }
}

// gemv_load for FP8 rows: one 16-byte load per row half and block ([..][1] unused).
template <int U, int NACC>
__device__ __forceinline__ void gemv_load_fp8(uint4 (&wv)[U][NACC][2][2], const fp8e4* const (&w0)[NACC],
                                              const fp8e4* const (&w1)[NACC], bool v0, bool v1, int kb, int kb_step,
                                              int kb_end) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
        const int kbu = kb + u * kb_step;
        const bool in = kbu < kb_end;
#pragma unroll
        for (int a = 0; a < NACC; ++a) {
            wv[u][a][0][0] = (in && v0) ? ldg_stream(w0[a] + 1024 * kbu) : zero4();
            wv[u][a][1][0] = (in && v1) ? ldg_stream(w1[a] + 1024 * kbu) : zero4();
        }
    }
}

// The bf16 pieces (first, second) of 16 bytes of an FP8 row half (the file comment's layout).
__device__ __forceinline__ void fp8_pieces(const uint4& v, uint4& p0, uint4& p1) {
    e4m3x4_to_bf16(v.x, p0.x, p0.y);
    e4m3x4_to_bf16(v.y, p0.z, p0.w);
    e4m3x4_to_bf16(v.z, p1.x, p1.y);
    e4m3x4_to_bf16(v.w, p1.z, p1.w);
}

// A warp item's per-block FP8 scales (WEIGHT_FORMAT 2): per row set, the scales of the 128-row
// block of its group (ceil(k / 128) of them), and the tile's first 64-column block of the matrix.
template <int NACC>
struct BlockScales {
    const float* row[NACC];
    int kb0;
};

// gemv_mma for FP8 rows: each block's pieces to bf16 first; with block scales each block's
// products go to acc times their block's scale.
template <int U, int NACC>
__device__ __forceinline__ void gemv_mma_fp8(const uint4 (&wv)[U][NACC][2][2], const bf16* xrow, int kb, int kb_step,
                                             int kb_end, float (&acc)[NACC][4], const BlockScales<NACC>& bs) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
        const int kbu = kb + u * kb_step;
        if (kbu < kb_end) {
            const int k = kbu * 64;
            const uint4 xa = lds16(xrow + k), xb = lds16(xrow + k + 32);
            const u32 xw[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
#pragma unroll
            for (int a = 0; a < NACC; ++a) {
                uint4 l0, l1, h0, h1;
                fp8_pieces(wv[u][a][0][0], l0, l1);
                fp8_pieces(wv[u][a][1][0], h0, h1);
                if constexpr (WEIGHT_FORMAT == 2) {
                    float part[4] = {};
                    mma_block(part, l0, l1, h0, h1, xw);
                    const float sc = __ldg(bs.row[a] + (bs.kb0 + kbu) / 2);
#pragma unroll
                    for (int i = 0; i < 4; ++i) acc[a][i] += part[i] * sc;
                } else {
                    mma_block(acc[a], l0, l1, h0, h1, xw);
                }
            }
        }
    }
}

// gemv_item for FP8 rows (the same two register batches in flight).
template <int NACC, class Fin>
__device__ __forceinline__ void gemv_item_fp8(const fp8e4* const (&w0)[NACC], const fp8e4* const (&w1)[NACC], bool v0,
                                              bool v1, const bf16* xrow, int kb_begin, int kb_step, int kb_end,
                                              float (&acc)[NACC][4], const Fin& finish, bool first,
                                              const BlockScales<NACC>& bs) {
    constexpr int U = gemv_batch_blocks<NACC>();
    const int batch = U * kb_step;
    uint4 wa[U][NACC][2][2], wb[U][NACC][2][2];
    gemv_load_fp8<U, NACC>(wa, w0, w1, v0, v1, kb_begin, kb_step, kb_end);
    if (first) finish();
    for (int kb = kb_begin; kb < kb_end; kb += 2 * batch) {
        gemv_load_fp8<U, NACC>(wb, w0, w1, v0, v1, kb + batch, kb_step, kb_end);
        gemv_mma_fp8<U, NACC>(wa, xrow, kb, kb_step, kb_end, acc, bs);
        if (kb + batch >= kb_end) break;
        gemv_load_fp8<U, NACC>(wa, w0, w1, v0, v1, kb + 2 * batch, kb_step, kb_end);
        gemv_mma_fp8<U, NACC>(wb, xrow, kb + batch, kb_step, kb_end, acc, bs);
    }
}

// Where a GEMV tile's FP8 scales are (mkc/ir/fp8.py): `s` the scales of its matrix (an expert's),
// `r0` the first row of each row set within it, `k_blocks` = ceil(k / 128) (per block: one row of
// scales per 128 rows), `kb0` the tile's first 64-column block.
template <int NACC>
struct WeightScales {
    const float* s;
    int r0[NACC];
    int k_blocks, kb0;
    // WEIGHT_FORMAT 2: the block scales of 16-row group gi
    __device__ __forceinline__ BlockScales<NACC> block(int gi) const {
        BlockScales<NACC> b{};
        if constexpr (WEIGHT_FORMAT == 2) {
#pragma unroll
            for (int a = 0; a < NACC; ++a) b.row[a] = s + (size_t)((r0[a] + gi * 16) / 128) * k_blocks;
            b.kb0 = kb0;
        }
        return b;
    }
    // WEIGHT_FORMAT 1: a finished fragment (rows r, r + 8 of every row set) times its rows' scales
    __device__ __forceinline__ void rows(float (&acc)[NACC][4], int r, int nrows) const {
        if constexpr (WEIGHT_FORMAT == 1) {
#pragma unroll
            for (int a = 0; a < NACC; ++a) {
                const float s0 = r < nrows ? __ldg(s + r0[a] + r) : 0.f;
                const float s1 = r + 8 < nrows ? __ldg(s + r0[a] + r + 8) : 0.f;
                acc[a][0] *= s0;
                acc[a][1] *= s0;
                acc[a][2] *= s1;
                acc[a][3] *= s1;
            }
        }
    }
};

// An FP8 tile's end of staging: the caller's `finish`, with the tile's scales beside it (the
// GEMV's only other input).
template <class Fin, int NACC>
struct WithScales {
    Fin fin;
    WeightScales<NACC> sc;
    __device__ void landed() const { fin.landed(); }
    __device__ void operator()() const { fin(); }
};

// A run of `units` weight units through two register batches of U units (wa holds the first
// batch, loaded by the caller): the loads of one batch fly while the other is multiplied.
// load(batch, i0) loads units i0 .. i0 + U - 1 (none past `units`), mma(batch, i0) multiplies them.
template <int U, class Batch, class Load, class Mma>
__device__ __forceinline__ void stream_batches(Batch& wa, Batch& wb, int units, const Load& load, const Mma& mma) {
    for (int i0 = 0; i0 < units; i0 += 2 * U) {
        load(wb, i0 + U);
        mma(wa, i0);
        if (i0 + U >= units) break;
        load(wa, i0 + 2 * U);
        mma(wb, i0 + U);
    }
}

// No-op end of staging for a tile whose activations the caller staged (this thread's copies are
// waited for).
struct Staged {
    __device__ void landed() const {}
    __device__ void operator()() const { cp_async_wait_all(); }
};

// rows x k tile: w[a] points at element (row 0, k 0) of row set a (row stride w_ld elements); xs
// is the activation tile in shared memory. Each warp issues the loads of its first weight batch,
// then every thread calls `finish` (which completes the caller's staging of xs and publishes it
// with a barrier: stage_*_async before the call, its finish here), so the weights' round trip
// overlaps the activations'.
// For every finished 16-row group the epilogue is called by all 32 lanes of one warp as
// epi(r0, acc) with acc[a] = {(r0, n), (r0, n + 1), (r0 + 8, n), (r0 + 8, n + 1)} where
// n = 2 * (lane % 4); r0 may be past `rows` (the epilogue checks). Every thread of the CTA must
// call this (it synchronises); `red` holds GEMV_RED_FLOATS.
template <int NACC, class Epi, bool NC = true, class Fin = Staged>
__device__ __forceinline__ void gemv_tile(const bf16* const (&w)[NACC], int w_ld, int rows, int k, const bf16* xs,
                                          float* red, Epi epi, Fin finish = Fin{}) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
    const int groups = (rows + 15) / 16, blocks = pad_k(k) / 64;
    int ks = 1;
    while (ks * 2 * groups <= NUM_WARPS && ks * 2 <= blocks) ks *= 2;
    const bf16* xrow = xs + g * xs_ld(pad_k(k)) + q * 8;
    stage_pad_zeros(const_cast<bf16*>(xs), k);  // the tile's own staging area (K_PADDED)
    // this warp's first item: group warp / ks, blocks part, part + ks, ...
    const int grp = warp / ks, part = warp % ks;
    const int r0 = grp * 16 + g, r1 = r0 + 8;
    // Finish the staging after the first weight loads are issued (each warp inside its first item;
    // warps without an item directly). With two row sets it finishes first and the op starts its
    // copies early instead (finishing after the first batch measured a tie).
    constexpr bool EARLY = NACC == 1;
    if (!EARLY) finish();
    if (ks == 1) {
        if (EARLY && warp >= groups) finish();  // warps without a row group
        for (int gi = warp; gi < groups; gi += NUM_WARPS) {
            const int s0 = gi * 16 + g, s1 = s0 + 8;
            const bf16* u0[NACC];
            const bf16* u1[NACC];
            group_rows<NACC, NC>(w, w_ld, gi, u0, u1);
            float acc[NACC][4] = {};
            gemv_item<NACC, NC>(u0, u1, s0 < rows, s1 < rows, xrow, 0, 1, blocks, acc, finish, EARLY && gi == warp);
            epi(s0, acc);
        }
        return;
    }
    // fewer groups than warps: warp = grp * ks + part, k split over the ks parts
    float acc[NACC][4] = {};
    if (EARLY && grp >= groups) finish();
    if (grp < groups) {
        const bf16* w0[NACC];
        const bf16* w1[NACC];
        group_rows<NACC, NC>(w, w_ld, grp, w0, w1);
        gemv_item<NACC, NC>(w0, w1, r0 < rows, r1 < rows, xrow, part, ks, blocks, acc, finish, EARLY);
        if (part != 0) {
#pragma unroll
            for (int a = 0; a < NACC; ++a)
#pragma unroll
                for (int i = 0; i < 4; ++i) red[((warp * NACC + a) * 4 + i) * 32 + lane] = acc[a][i];
        }
    }
    __syncthreads();
    if (grp < groups && part == 0) {
        for (int p = 1; p < ks; ++p)
#pragma unroll
            for (int a = 0; a < NACC; ++a)
#pragma unroll
                for (int i = 0; i < 4; ++i) acc[a][i] += red[(((warp + p) * NACC + a) * 4 + i) * 32 + lane];
        epi(grp * 16 + g, acc);
    }
}

// gemv_tile for FP8 rows, their scales in `finish` (WithScales): the same work split, each warp item
// through gemv_item_fp8. (A twin rather than a type parameter of gemv_tile: bf16 tiles keep the code
// they compiled to before FP8 existed, instruction for instruction.)
template <int NACC, class Epi, class Fin>
__device__ __forceinline__ void gemv_tile(const fp8e4* const (&w)[NACC], int w_ld, int rows, int k, const bf16* xs,
                                          float* red, Epi epi, Fin finish) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
    const int groups = (rows + 15) / 16, blocks = k / 64;
    int ks = 1;
    while (ks * 2 * groups <= NUM_WARPS && ks * 2 <= blocks) ks *= 2;
    const bf16* xrow = xs + g * xs_ld(k) + q * 8;
    // this warp's first item: group warp / ks, blocks part, part + ks, ...
    const int grp = warp / ks, part = warp % ks;
    const int r0 = grp * 16 + g, r1 = r0 + 8;
    // Finish the staging after the first weight loads are issued (each warp inside its first item;
    // warps without an item directly). With two row sets it finishes first and the op starts its
    // copies early instead (finishing after the first batch measured a tie).
    constexpr bool EARLY = NACC == 1;
    if (!EARLY) finish();
    if (ks == 1) {
        if (EARLY && warp >= groups) finish();  // warps without a row group
        for (int gi = warp; gi < groups; gi += NUM_WARPS) {
            const int s0 = gi * 16 + g, s1 = s0 + 8;
            const fp8e4* u0[NACC];
            const fp8e4* u1[NACC];
            float acc[NACC][4] = {};
            group_rows_fp8<NACC>(w, w_ld, gi, u0, u1);
            gemv_item_fp8<NACC>(u0, u1, s0 < rows, s1 < rows, xrow, 0, 1, blocks, acc, finish, EARLY && gi == warp,
                                finish.sc.block(gi));
            finish.sc.rows(acc, s0, rows);
            epi(s0, acc);
        }
        return;
    }
    // fewer groups than warps: warp = grp * ks + part, k split over the ks parts
    float acc[NACC][4] = {};
    if (EARLY && grp >= groups) finish();
    if (grp < groups) {
        const fp8e4* w0[NACC];
        const fp8e4* w1[NACC];
        group_rows_fp8<NACC>(w, w_ld, grp, w0, w1);
        gemv_item_fp8<NACC>(w0, w1, r0 < rows, r1 < rows, xrow, part, ks, blocks, acc, finish, EARLY,
                            finish.sc.block(grp));
        if (part != 0) {
#pragma unroll
            for (int a = 0; a < NACC; ++a)
#pragma unroll
                for (int i = 0; i < 4; ++i) red[((warp * NACC + a) * 4 + i) * 32 + lane] = acc[a][i];
        }
    }
    __syncthreads();
    if (grp < groups && part == 0) {
        for (int p = 1; p < ks; ++p)
#pragma unroll
            for (int a = 0; a < NACC; ++a)
#pragma unroll
                for (int i = 0; i < 4; ++i) acc[a][i] += red[(((warp + p) * NACC + a) * 4 + i) * 32 + lane];
        finish.sc.rows(acc, grp * 16 + g, rows);
        epi(grp * 16 + g, acc);
    }
}

// The 4 accumulator entries of a GEMV fragment as (row, column, value), rows < rows, cols < cols.
template <class F>
__device__ __forceinline__ void for_fragment(int r0, const float (&c)[4], int rows, F f, int cols = BATCH) {
    const int n = 2 * (threadIdx.x % 4);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int r = r0 + (i >= 2 ? 8 : 0), col = n + (i & 1);
        if (r < rows && col < cols) f(r, col, c[i]);
    }
}

// A GEMV with a short reduction, k = 64 NB (NB a compile-time block count; a fused expert tile's
// down projection: every hidden row over the tile's own intermediate rows, ops.cuh: op_expert_mlp).
// gemv_tile would give each 16-row group one short item and drain the stream at every group; here
// each warp streams its groups (warp, warp + NUM_WARPS, ...) as one run of (group, block) units,
// U blocks per register batch with two batches in flight across group boundaries. xs holds the
// activations staged as gemv_tile's (row stride xs_ld(64 NB)); epi(r0, acc) as gemv_tile's, once
// per group, after its last block. Weights are read with the streaming path (immutable weights).
// No barrier: every thread of the CTA may call it, each warp alone.
template <int NB, class Epi>
__device__ __forceinline__ void gemv_short_k(const bf16* w, int w_ld, int rows, const bf16* xs, Epi epi) {
    constexpr int U = gemv_batch_blocks<1>();
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
    const int groups = (rows + 15) / 16;
    const int units = (groups > warp ? (groups - warp + NUM_WARPS - 1) / NUM_WARPS : 0) * NB;
    const bf16* xrow = xs + g * xs_ld(64 * NB) + q * 8;
    // unit i: block i % NB of this warp's group i / NB, that is group warp + (i / NB) * NUM_WARPS
    const auto load = [&](uint4 (&wv)[U][2][2], int i0) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int i = i0 + u, gi = warp + (i / NB) * NUM_WARPS;
            const bool v0 = i < units && gi * 16 + g < rows, v1 = i < units && gi * 16 + g + 8 < rows;
            const bf16* const one[1] = {w};
            const bf16* w0[1];
            const bf16* w1[1];
            group_rows<1, true>(one, w_ld, gi, w0, w1);
            const int k = (i % NB) * block_stride<true>(), h = half_offset<true>();
            wv[u][0][0] = v0 ? ldg_stream(w0[0] + k) : zero4();
            wv[u][0][1] = v0 ? ldg_stream(w0[0] + k + h) : zero4();
            wv[u][1][0] = v1 ? ldg_stream(w1[0] + k) : zero4();
            wv[u][1][1] = v1 ? ldg_stream(w1[0] + k + h) : zero4();
        }
    };
    float acc[1][4] = {};
    const auto mma = [&](const uint4 (&wv)[U][2][2], int i0) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int i = i0 + u, kb = i % NB;
            if (i < units) {
                if (kb == 0 && i > 0) {  // the group before is done
                    epi((warp + (i / NB - 1) * NUM_WARPS) * 16 + g, acc);
#pragma unroll
                    for (int j = 0; j < 4; ++j) acc[0][j] = 0.f;
                }
                const uint4 xa = lds16(xrow + kb * 64), xb = lds16(xrow + kb * 64 + 32);
                const u32 xw[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
                mma_block(acc[0], wv[u][0][0], wv[u][0][1], wv[u][1][0], wv[u][1][1], xw);
            }
        }
    };
    uint4 wa[U][2][2], wb[U][2][2];
    load(wa, 0);
    stream_batches<U>(wa, wb, units, load, mma);
    if (units) epi((warp + (units / NB - 1) * NUM_WARPS) * 16 + g, acc);
}
