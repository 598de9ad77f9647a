// Split-K decode attention (flash-decoding) for one (sequence, KV head, key split) and the combine
// of the splits. GQA: the GROUP query heads of a KV head share every key/value row they read.
//
// Key range of a split (the CPU executor may place its splits differently; only the combined
// result is the contract): the token at position p attends keys [base, p] with base = 0 for
// global layers and max(0, p - window + 1) for sliding ones; split s covers
// [base + s * split_keys, min(p + 1, base + (s + 1) * split_keys)). An empty split writes
// m = -inf, l = 0, o = 0, which the combine weighs by exp(-inf) = 0.
#pragma once

constexpr int ATT_DC = HEAD_DIM / 8;           // 16-byte chunks per K/V row
// Q.K on the tensor cores when the head fits the GEMV tile (k = head_dim, a multiple of 64; the
// query heads of the group as the 8 columns): the key rows are the A operand, like weight rows.
constexpr bool ATT_MMA = HEAD_DIM % 64 == 0 && GROUP <= 8;
constexpr int ATT_QX_BYTES = (8 * (HEAD_DIM + XS_PAD) * 2 + 127) / 128 * 128;  // q heads staged as bf16
constexpr int ATT_GRED_FLOATS = NUM_WARPS * 4 * 32;                      // GEMV k-split reduction
constexpr int ATT_KL = NUM_THREADS / ATT_DC;    // key lanes of the P.V phase
constexpr int ATT_CHUNK = NUM_THREADS;          // keys per pass (one per thread in the Q.K phase)
static_assert(HEAD_DIM % 8 == 0 && NUM_THREADS % ATT_DC == 0, "attention: head_dim / threads");
// the key-lane buffer, which before the chunks holds the rows a split that rotates its own query
// takes from qkv ([GROUP + 2][HEAD_DIM] bf16: query heads, key, value) and their qk-norm factors
constexpr int ATT_RED_FLOATS = ATT_KL * HEAD_DIM > ((GROUP + 2) * HEAD_DIM * 2 + (GROUP + 1) * 4 + 3) / 4
                                   ? ATT_KL * HEAD_DIM : ((GROUP + 2) * HEAD_DIM * 2 + (GROUP + 1) * 4 + 3) / 4;
// After the layout below (16-aligned), this chunk's V rows [ATT_CHUNK][HEAD_DIM] bf16;
// after the last chunk the same bytes hold every head's key-lane partials [GROUP][ATT_KL][HEAD_DIM]
// (mkc/codegen/render.py sizes it as the larger of the two)
constexpr int ATT_VS_OFF = (ATT_QX_BYTES + (ATT_GRED_FLOATS + GROUP * HEAD_DIM + GROUP * ATT_CHUNK +
                                            ATT_RED_FLOATS + 3 * GROUP) * 4 + 15) / 16 * 16;
constexpr int ATT_VS_BYTES = ATT_CHUNK * HEAD_DIM * 2 > GROUP * ATT_KL * HEAD_DIM * 4 ? ATT_CHUNK * HEAD_DIM * 2
                                                                                    : GROUP * ATT_KL * HEAD_DIM * 4;
static_assert(ATT_VS_OFF + ATT_VS_BYTES <= SMEM_BYTES, "attention: V chunk past the shared memory");

// sin and cos of the RoPE angle pos * theta^(-2p / head_dim), the angle rounded to float as in
// the reference (inv_freq in float, times the position in float). The angle is reduced modulo
// 2 pi in double, so the fast hardware sin/cos (abs. error ~1e-6 on [-pi, pi]) suffice and the
// slow Payne-Hanek path of sincosf (a local-memory table) is never compiled in.
__device__ __forceinline__ void rope_sincos(int pos, int p, float& sn, float& cs) {
    const float inv_freq = 1.f / powf(ROPE_THETA, (float)(2 * p) / (float)HEAD_DIM);
    const double angle = (double)((float)pos * inv_freq);
    const double two_pi = 6.283185307179586;
    const float r = (float)(angle - rint(angle * (1.0 / two_pi)) * two_pi);
    __sincosf(r, &sn, &cs);
}

// qk-norm factor of one head row (one warp; every lane returns it): rsqrt(mean(x^2) + eps)
__device__ __forceinline__ float head_rinv(const bf16* row, int lane) {
    float ss = 0.f;
    for (int i = lane; i < HEAD_DIM; i += 32) {
        const float v = __bfloat162float(row[i]);
        ss = __fmaf_rn(v, v, ss);
    }
    return rsqrtf(warp_sum(ss) / (float)HEAD_DIM + NORM_EPS);
}

// Element pair p of a head row (ia, ib: GPT-J or NeoX pairing) as ROPE_APPEND and the attention
// splits both compute it, rounded alike everywhere (explicit roundings, no contraction left to
// the compiler): qk-norm with weight w (nullptr: none) and factor r, rounded to bf16, times the
// bf16 weight, rounded again (as transformers), then RoPE at pos in float (rope: else unrotated).
// sc: the angle's sine and cosine for pair p where already known (rope_table), else nullptr.
__device__ __forceinline__ void rope_pair(const bf16* row, int p, int pos, bool rope, const bf16* w, float r,
                                          float& oa, float& ob, int& ia, int& ib, const float2* sc = nullptr) {
    ia = ROPE_INTERLEAVED ? 2 * p : p;
    ib = ROPE_INTERLEAVED ? 2 * p + 1 : p + HEAD_DIM / 2;
    float a = __bfloat162float(row[ia]), c = __bfloat162float(row[ib]);
    if (w) {
        a = bf16_round(bf16_round(__fmul_rn(a, r)) * __bfloat162float(w[ia]));
        c = bf16_round(bf16_round(__fmul_rn(c, r)) * __bfloat162float(w[ib]));
    }
    if (rope) {
        float sn, cs;
        if (sc) sn = sc[p].x, cs = sc[p].y;
        else rope_sincos(pos, p, sn, cs);
        oa = __fmaf_rn(a, cs, -__fmul_rn(c, sn));
        ob = __fmaf_rn(c, cs, __fmul_rn(a, sn));
    } else {
        oa = a;
        ob = c;
    }
}

#if MKC_PAGED
// Paged KV cache (MKC_PAGED, mkc/ir/kv_layout.py): the K (or V) rows of one (sequence, KV head) are
// pages of PAGE_SIZE rows of the head's pool [kv_heads, pages, PAGE_SIZE, HEAD_DIM], found through
// the sequence's page-table row. Rows j .. j + run(j) - 1 are contiguous. Without MKC_PAGED every
// sequence has one slab [B, kv_heads, ctx, HEAD_DIM] and the code below is not compiled at all
// (the contiguous kernel is exactly the one measured and tested before paging existed).
struct KvRows {
    const bf16* base;  // slab: row 0 of the sequence's head; paged: page 0 of the head's pool
    const int* table;  // paged: the sequence's page-table row (an input: never written in a step)
    __device__ __forceinline__ const bf16* row(int j) const {
        return base + ((size_t)__ldg(table + j / PAGE_SIZE) * PAGE_SIZE + j % PAGE_SIZE) * HEAD_DIM;
    }
    __device__ __forceinline__ int run(int j) const { return PAGE_SIZE - j % PAGE_SIZE; }
};

// KvRows of the k_cache (or v_cache) operand `cache` for sequence b, KV head g (page table
// [B, pages per sequence]).
template <class O>
__device__ __forceinline__ KvRows kv_rows(const Task& t, int cache, int b, int g) {
    const int pages = t.dim(cache, 3);
    return {t.ptr<bf16>(cache) + (size_t)g * pages * PAGE_SIZE * HEAD_DIM,
            t.ptr<int>(O::page_table) + (size_t)b * t.dim(O::page_table, 1)};
}
#endif

// The position of the sequence of the split that runs next: read by the warps that prefetch its
// rows while warp 0 waits (ops.cuh: prefetch_weights), so the split itself starts without that
// round trip (positions are an input: the host writes them before the launch).
__shared__ int s_split_pos;
static_assert(NUM_THREADS > 32, "a split's position is read by warp 1 (prefetch_weights)");

// The sine and cosine of every pair's RoPE angle at the split's position,
// computed by warps 1.. while warp 0 waits for the split's query (prefetch_weights: rope_table),
// so the query's staging after the wait only looks them up. The same rope_sincos, so the same bits.
__shared__ float2 s_rope_sc[HEAD_DIM / 2];
static_assert(NUM_THREADS - 32 >= HEAD_DIM / 2, "rope_table: one thread of warps 1.. per pair");

// Called by warps 1.. before the split's wait (published by the kernel loop's barrier).
__device__ __forceinline__ void rope_table(int pos) {
    const int p = (int)threadIdx.x - 32;
    if (p >= 0 && p < HEAD_DIM / 2) {
        float sn, cs;
        rope_sincos(pos, p, sn, cs);
        s_rope_sc[p] = make_float2(sn, cs);
    }
}

// The split's sequence position, read from global memory (positions: an input of the step)
__device__ __forceinline__ int split_position(const Task& t) {
    return ld_act_i32(t.ptr<int>(OPND_ATTN_SPLIT::positions) + t.arg(ARG_ATTN_SPLIT::seq));
}

// [lo, hi) of the keys this split attends at position pos (empty when lo >= hi)
__device__ __forceinline__ void attn_key_range(const Task& t, int pos, int& lo, int& hi) {
    using A = ARG_ATTN_SPLIT;
    const int window = t.arg(A::window), split_keys = t.arg(A::split_keys);
    const int base = window > 0 ? max(0, pos - window + 1) : 0;
    lo = base + t.arg(A::split) * split_keys;
    hi = min(pos + 1, lo + split_keys);
}

// A split with a qkv operand (LowerOptions.rope_in_splits) stages its query itself: the GROUP
// query heads of sequence b, KV group g from qkv, qk-norm (q_norm / k_norm operands) and RoPE as
// ROPE_APPEND computes them (rope_pair), rounded to bf16 as ROPE_APPEND stores them, into qx (the
// MMA's B operand, rows >= GROUP zero) or qs (scaled floats, CUDA-core path). With `own` (the
// split holds the step's position) also the key head, rotated in place, and the value head: both
// stay in `rows` ([GROUP + 2][HEAD_DIM] bf16, then [GROUP + 1] f32 qk-norm factors) for the chunks.
// pos: the sequence's position. Ends with a barrier.
__device__ void stage_own_query(const Task& t, int b, int g, int pos, bool own, bf16* qx, float* qs, bf16* rows) {
    using O = OPND_ATTN_SPLIT;
    using A = ARG_ATTN_SPLIT;
    constexpr int CH = HEAD_DIM / 8, HALF = HEAD_DIM / 2;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
#if MKC_PAGED
    const int kv_heads = t.dim(O::k_cache, 4);
#else
    const int kv_heads = t.dim(O::k_cache, 3);
#endif
    const int qkv_ld = t.dim(O::qkv, 1), q_heads = qkv_ld / HEAD_DIM - 2 * kv_heads;
    const int nrows = GROUP + (own ? 2 : 0), nrot = GROUP + (own ? 1 : 0);
    const bf16* qkv = t.ptr<bf16>(O::qkv) + (size_t)b * qkv_ld;
    float* rinv = reinterpret_cast<float*>(rows + (GROUP + 2) * HEAD_DIM);
    for (int i = tid; i < nrows * CH; i += NUM_THREADS) {
        const int j = i / CH, c = i % CH;
        const int head = j < GROUP ? g * GROUP + j : (j == GROUP ? q_heads + g : q_heads + kv_heads + g);
        *reinterpret_cast<uint4*>(rows + j * HEAD_DIM + c * 8) = ld_act16(qkv + (size_t)head * HEAD_DIM + c * 8);
    }
    if constexpr (ATT_MMA)  // the padding rows of the MMA's B operand
        for (int i = tid; i < (8 - GROUP) * CH; i += NUM_THREADS)
            *reinterpret_cast<uint4*>(qx + (GROUP + i / CH) * xs_ld(HEAD_DIM) + (i % CH) * 8) = zero4();
    __syncthreads();
    const bool qk_norm = t.has(O::q_norm);
    if (qk_norm) {
        for (int r = warp; r < nrot; r += NUM_WARPS) {
            const float v = head_rinv(rows + r * HEAD_DIM, lane);
            if (lane == 0) rinv[r] = v;
        }
        __syncthreads();
    }
    const bool rope = t.arg(A::rope) != 0;
    const bf16* qn = t.ptr<bf16>(O::q_norm);
    const bf16* kn = t.ptr<bf16>(O::k_norm);
    for (int i = tid; i < nrot * HALF; i += NUM_THREADS) {
        const int j = i / HALF, p = i % HALF;
        float a, c;
        int ia, ib;
        rope_pair(rows + j * HEAD_DIM, p, pos, rope, qk_norm ? (j < GROUP ? qn : kn) : nullptr,
                  qk_norm ? rinv[j] : 1.f, a, c, ia, ib, s_rope_sc);
        if (j == GROUP) {  // the key, in place: this thread alone reads and writes elements ia and ib
            store_bf16(rows + j * HEAD_DIM + ia, a);
            store_bf16(rows + j * HEAD_DIM + ib, c);
        } else if constexpr (ATT_MMA) {
            store_bf16(qx + j * xs_ld(HEAD_DIM) + ia, a);
            store_bf16(qx + j * xs_ld(HEAD_DIM) + ib, c);
        } else {
            qs[j * HEAD_DIM + ia] = bf16_round(a) * ATTN_SCALE;
            qs[j * HEAD_DIM + ib] = bf16_round(c) * ATTN_SCALE;
        }
    }
    __syncthreads();
}

// ---- warp splits (CodegenOptions.attn_warp_stages > 0; the tensor-core Q.K only) -----------------
// Each warp of a split runs its own flash-decoding pass over the split's 16-key blocks w,
// w + NUM_WARPS, ..., so the key loop has no CTA barrier; the warps' (m, l, o) are merged at the
// end in a fixed order. Both products run on the tensor cores with the query heads as the 16 rows
// of A (rows >= GROUP zero): S^T = Q K^T with 8 keys as the n columns (two tiles per block), then
// O += P V with P rounded to bf16 (the A operand, straight from the S accumulators) and 8 of the
// head's dims as the n columns (HEAD_DIM / 8 tiles). The sums run over permuted orders that the
// operands share, so each lane copies its operands with whole 16-byte pieces:
// - K: lane (g, t) holds elements [64 kb + 8 t, +8) and [64 kb + 32 + 8 t, +8) of key g of each
//   tile, the GEMV's permutation of k (gemv.cuh), which the query fragments use too;
// - V: output tile j = 8 h + e holds dims 64 h + 8 n + e for n = 0..7, so lane (g, t) needs dims
//   [64 h + 8 g, +8) of keys 2t, 2t + 1, 2t + 8, 2t + 9, and its accumulators hold
//   dims 64 h + 16 t + e and 64 h + 16 t + 8 + e of head g.
// Every lane copies exactly the pieces it reads (cp.async, L2 only) into its own slots of the
// warp's ring of ATTN_WARP_STAGES blocks, so it waits for its own copies only. A split that
// rotates its own query issues its first blocks while it waits for the QKV tiles (ops.cuh:
// prefetch_weights, warps 1..): those rows were written by earlier steps, and the step's own key
// and value are taken from qkv in place of the cache row.
constexpr bool ATT_WARP = ATTN_WARP_STAGES > 0 && ATT_MMA;
constexpr int ATTW_STAGES = ATTN_WARP_STAGES > 1 ? ATTN_WARP_STAGES : 2;
constexpr int ATTW_KP = HEAD_DIM / 32;          // 16-byte pieces of one K row a lane holds
constexpr int ATTW_VP = HEAD_DIM / 64;          // 16-byte pieces of one V row a lane holds
constexpr int ATTW_KB = HEAD_DIM >= 64 ? HEAD_DIM / 64 : 1;  // 64-wide k blocks (1: never run, see ATT_WARP)
constexpr int ATTW_PIECES = 2 * ATTW_KP + 4 * ATTW_VP;  // per lane and block: 2 keys of K, 4 of V
// after the query heads (qx): the split's own q / k / v rows and qk-norm factors (stage_own_query),
// then the rings; after the key loop the rings hold every warp's m, l and o for the merge
constexpr int ATTW_ROWS_OFF = ATT_QX_BYTES;
constexpr int ATTW_RING_OFF = (ATTW_ROWS_OFF + (GROUP + 2) * HEAD_DIM * 2 + (GROUP + 1) * 4 + 127) / 128 * 128;
constexpr int ATTW_RING_BYTES = ATTW_STAGES * ATTW_PIECES * 32 * 16;  // per warp
static_assert(!ATT_WARP || ATTN_WARP_STAGES >= 2, "attention warp splits need at least two ring stages");
static_assert(!ATT_WARP || ATTW_RING_OFF + NUM_WARPS * ATTW_RING_BYTES <= SMEM_BYTES,
              "attention: warp rings past the shared memory (mkc/codegen/render.py sizes them)");
// the warps' merge (attn_split_warps): per warp and head its m and l, then per head m and l, then
// per warp and head its o in rows of ATTW_O_LD floats (the 16-byte pad puts a warp's float4 stores
// on every bank)
constexpr int ATTW_O_LD = HEAD_DIM + 4;
constexpr int ATTW_O_OFF = (2 * NUM_WARPS * GROUP + 2 * GROUP + 3) / 4 * 4;  // floats, 16-byte aligned
static_assert(!ATT_WARP || (ATTW_O_OFF + NUM_WARPS * GROUP * ATTW_O_LD) * 4 <= NUM_WARPS * ATTW_RING_BYTES,
              "attention: the warps' merge does not fit their rings");

// The K and V rows of one (sequence, KV head).
struct AttnRows {
#if MKC_PAGED
    KvRows k, v;
    __device__ __forceinline__ const bf16* krow(int j) const { return k.row(j); }
    __device__ __forceinline__ const bf16* vrow(int j) const { return v.row(j); }
#else
    const bf16* kc;
    const bf16* vc;
    __device__ __forceinline__ const bf16* krow(int j) const { return kc + (size_t)j * HEAD_DIM; }
    __device__ __forceinline__ const bf16* vrow(int j) const { return vc + (size_t)j * HEAD_DIM; }
#endif
};

__device__ __forceinline__ AttnRows attn_rows(const Task& t) {
    using O = OPND_ATTN_SPLIT;
    using A = ARG_ATTN_SPLIT;
    const int b = t.arg(A::seq), g = t.arg(A::kv_head);
#if MKC_PAGED
    return {kv_rows<O>(t, O::k_cache, b, g), kv_rows<O>(t, O::v_cache, b, g)};
#else
    const size_t row0 = ((size_t)b * t.dim(O::k_cache, 3) + g) * t.dim(O::k_cache, 2);
    return {t.ptr<bf16>(O::k_cache) + row0 * HEAD_DIM, t.ptr<bf16>(O::v_cache) + row0 * HEAD_DIM};
#endif
}

// this lane's slot of stage 0 of this warp's ring; piece p of stage s is at [(s * ATTW_PIECES + p) * 32]
__device__ __forceinline__ uint4* attw_ring_lane(unsigned char* smem) {
    return reinterpret_cast<uint4*>(smem + ATTW_RING_OFF + (threadIdx.x / 32) * ATTW_RING_BYTES) + threadIdx.x % 32;
}

// Copy this lane's pieces of the block of keys [k0, k0 + 16) (those below hi) into stage st, as
// one cp.async group (empty when the block is past hi).
__device__ __forceinline__ void attw_issue(uint4* ring, int st, const AttnRows& r, int k0, int hi) {
    if (k0 < hi) {
        const int lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
        uint4* s = ring + st * ATTW_PIECES * 32;
#pragma unroll
        for (int kt = 0; kt < 2; ++kt) {
            const int key = k0 + 8 * kt + g;
            if (key < hi) {
                const bf16* row = r.krow(key) + 8 * q;
#pragma unroll
                for (int p = 0; p < ATTW_KP; ++p) cp_async16_stream(s + (kt * ATTW_KP + p) * 32, row + 32 * p);
            }
        }
#pragma unroll
        for (int vk = 0; vk < 4; ++vk) {
            const int key = k0 + 2 * q + (vk & 1) + 8 * (vk >> 1);
            if (key < hi) {
                const bf16* row = r.vrow(key) + 8 * g;
#pragma unroll
                for (int h = 0; h < ATTW_VP; ++h) cp_async16_stream(s + (2 * ATTW_KP + vk * ATTW_VP + h) * 32, row + 64 * h);
            }
        }
    }
    cp_async_commit();
}

// Blocks per warp issued before the key loop: ATTW_STAGES - 1, so that the loop's first pass issues
// the next into the last stage.
constexpr int ATTW_EARLY = ATTW_STAGES - 1;

// The first ATTW_EARLY blocks of this warp (after committing the thread's earlier copies as their
// own group).
__device__ __forceinline__ void attw_prologue(uint4* ring, const AttnRows& r, int lo, int hi) {
    cp_async_commit();
#pragma unroll
    for (int i = 0; i < ATTW_EARLY; ++i)
        attw_issue(ring, i, r, lo + 16 * ((int)threadIdx.x / 32 + i * NUM_WARPS), hi);
}

__device__ void attn_split_warps(const Task& t, unsigned char* smem) {
    using O = OPND_ATTN_SPLIT;
    using A = ARG_ATTN_SPLIT;
    const int b = t.arg(A::seq), g = t.arg(A::kv_head), sp = t.arg(A::split);
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, lg = lane / 4, lq = lane % 4;
#if MKC_PAGED
    const int kv_heads = t.dim(O::k_cache, 4);
#else
    const int kv_heads = t.dim(O::k_cache, 3);
#endif
    const int pos = s_split_pos;  // read while warp 0 waited (prefetch_weights)
    int lo, hi;
    attn_key_range(t, pos, lo, hi);
    const AttnRows rows = attn_rows(t);
    bf16* qx = reinterpret_cast<bf16*>(smem);  // [8][HEAD_DIM + XS_PAD] query heads (rows >= GROUP zero)
    bf16* own_rows = reinterpret_cast<bf16*>(smem + ATTW_ROWS_OFF);  // [GROUP + 2][HEAD_DIM] q, k, v
    uint4* ring = attw_ring_lane(smem);
    const bool fused = t.has(O::qkv);
    // warps 1.. of a split that rotates its own query issued their first blocks while it waited
    if (!fused || warp == 0) attw_prologue(ring, rows, lo, hi);
    const int own = fused && lo <= pos && pos < hi ? pos : -1;  // the key taken from qkv (-1: none)
    const bf16* own_k = own_rows + GROUP * HEAD_DIM;
    const bf16* own_v = own_k + HEAD_DIM;
    if (fused) stage_own_query(t, b, g, pos, own >= 0, qx, nullptr, own_rows);
    else {
        stage_x(qx, t.ptr<bf16>(O::q) + (size_t)b * t.dim(O::q, 1) + (size_t)g * GROUP * HEAD_DIM, HEAD_DIM, 0, HEAD_DIM,
                GROUP);
        __syncthreads();
    }
    prof_staged();  // the query is staged (after the barrier: a profile's "staging" ends here)
    // the query fragments (A operand, row lg; rows lg + 8 are zero): the permuted k of the K pieces
    u32 qa[ATTW_KB][8];
#pragma unroll
    for (int kb = 0; kb < ATTW_KB; ++kb) {
        const bf16* qr = qx + lg * xs_ld(HEAD_DIM) + 64 * kb + 8 * lq;
        const uint4 x0 = lds16(qr), x1 = lds16(qr + 32);
        qa[kb][0] = x0.x; qa[kb][1] = x0.y; qa[kb][2] = x0.z; qa[kb][3] = x0.w;
        qa[kb][4] = x1.x; qa[kb][5] = x1.y; qa[kb][6] = x1.z; qa[kb][7] = x1.w;
    }
    float o[HEAD_DIM / 8][4];
#pragma unroll
    for (int j = 0; j < HEAD_DIM / 8; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
    float m_run = -INFINITY, l_run = 0.f;  // head lg: the quad's running max, this lane's share of the sum

    const int nblk = hi > lo ? (hi - lo + 15) / 16 : 0;
    int st = 0;
#pragma unroll 1
    for (int i = 0; warp + i * NUM_WARPS < nblk; ++i) {
        const int k0 = lo + 16 * (warp + i * NUM_WARPS);
        // block i + STAGES - 1 into the stage block i - 1 used
        attw_issue(ring, st == 0 ? ATTW_STAGES - 1 : st - 1, rows, k0 + 16 * NUM_WARPS * (ATTW_STAGES - 1), hi);
        cp_async_wait_group<ATTW_STAGES - 1>();  // this block's pieces have landed
        const uint4* s = ring + st * ATTW_PIECES * 32;
        // S^T of the two 8-key tiles: c0, c1 = head lg, keys k0 + 8 kt + 2 lq (+1)
        float sc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
        for (int kt = 0; kt < 2; ++kt) {
            const bool mine = k0 + 8 * kt + lg == own;
#pragma unroll
            for (int kb = 0; kb < ATTW_KB; ++kb) {
                const uint4 k_lo = mine ? lds16(own_k + 64 * kb + 8 * lq) : s[(kt * ATTW_KP + 2 * kb) * 32];
                const uint4 k_hi = mine ? lds16(own_k + 64 * kb + 32 + 8 * lq) : s[(kt * ATTW_KP + 2 * kb + 1) * 32];
                const u32 kw[8] = {k_lo.x, k_lo.y, k_lo.z, k_lo.w, k_hi.x, k_hi.y, k_hi.z, k_hi.w};
#pragma unroll
                for (int s4 = 0; s4 < 4; ++s4)
                    mma_16816(sc[kt], qa[kb][2 * s4], 0u, qa[kb][2 * s4 + 1], 0u, kw[2 * s4], kw[2 * s4 + 1]);
            }
        }
        // online softmax of head lg over the block (the quad holds its 16 keys)
        float sv[4];
#pragma unroll
        for (int i4 = 0; i4 < 4; ++i4) {
            const int key = k0 + 8 * (i4 >> 1) + 2 * lq + (i4 & 1);
            sv[i4] = key < hi ? sc[i4 >> 1][i4 & 1] * ATTN_SCALE : -INFINITY;
        }
        float mx = fmaxf(fmaxf(sv[0], sv[1]), fmaxf(sv[2], sv[3]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float m_new = fmaxf(m_run, mx);  // finite: every block has a key below hi
        const float alpha = __expf(m_run - m_new);
        float p[4];
#pragma unroll
        for (int i4 = 0; i4 < 4; ++i4) p[i4] = bf16_round(__expf(sv[i4] - m_new));
        l_run = l_run * alpha + ((p[0] + p[1]) + (p[2] + p[3]));
        m_run = m_new;
        const u32 pa0 = pack_bf16x2(p[0], p[1]), pa2 = pack_bf16x2(p[2], p[3]);
        // O += P V: the V pieces of keys k0 + 2 lq, +1, +8, +9 (zeros past hi), dims [64 h + 8 lg, +8)
#pragma unroll
        for (int h = 0; h < ATTW_VP; ++h) {
            uint4 v[4];
#pragma unroll
            for (int vk = 0; vk < 4; ++vk) {
                const int key = k0 + 2 * lq + (vk & 1) + 8 * (vk >> 1);
                v[vk] = key == own ? lds16(own_v + 64 * h + 8 * lg)
                        : key < hi ? s[(2 * ATTW_KP + vk * ATTW_VP + h) * 32] : zero4();
            }
            const u32 w0[4] = {v[0].x, v[0].y, v[0].z, v[0].w}, w1[4] = {v[1].x, v[1].y, v[1].z, v[1].w};
            const u32 w2[4] = {v[2].x, v[2].y, v[2].z, v[2].w}, w3[4] = {v[3].x, v[3].y, v[3].z, v[3].w};
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                const u32 sel = (e & 1) ? 0x7632u : 0x5410u;  // the high or low bf16 of each word
                float(&c)[4] = o[8 * h + e];
                c[0] *= alpha;  // c[2], c[3] (rows lg + 8) stay zero
                c[1] *= alpha;
                mma_16816(c, pa0, 0u, pa2, 0u, __byte_perm(w0[e / 2], w1[e / 2], sel), __byte_perm(w2[e / 2], w3[e / 2], sel));
            }
        }
        st = st + 1 == ATTW_STAGES ? 0 : st + 1;
    }
    l_run += __shfl_xor_sync(0xffffffffu, l_run, 1);
    l_run += __shfl_xor_sync(0xffffffffu, l_run, 2);

    // merge the warps (fixed order) into the split's partials: m = max_w m_w, c_w = exp(m_w - m),
    // l = sum_w c_w l_w, o = sum_w c_w o_w (an empty split: m = -inf, l = 0, o = 0); one thread per
    // head derives m, l and the c_w first, so each output element reads only c_w and o_w
    cp_async_wait_all();
    __syncthreads();  // every warp is done with its ring
    float* wm = reinterpret_cast<float*>(smem + ATTW_RING_OFF);  // [NUM_WARPS][GROUP] m_w, then c_w
    float* wl = wm + NUM_WARPS * GROUP;                          // [NUM_WARPS][GROUP] l_w
    float* hm = wl + NUM_WARPS * GROUP;                          // [GROUP] m, then [GROUP] l
    float* wo = wm + ATTW_O_OFF;                                 // [NUM_WARPS][GROUP][ATTW_O_LD] o_w
    if (lg < GROUP) {
        if (lq == 0) {
            wm[warp * GROUP + lg] = m_run;
            wl[warp * GROUP + lg] = l_run;
        }
        float* row = wo + (warp * GROUP + lg) * ATTW_O_LD + 16 * lq;
#pragma unroll
        for (int h = 0; h < ATTW_VP; ++h) {
            float4* d = reinterpret_cast<float4*>(row + 64 * h);
            d[0] = make_float4(o[8 * h][0], o[8 * h + 1][0], o[8 * h + 2][0], o[8 * h + 3][0]);
            d[1] = make_float4(o[8 * h + 4][0], o[8 * h + 5][0], o[8 * h + 6][0], o[8 * h + 7][0]);
            d[2] = make_float4(o[8 * h][1], o[8 * h + 1][1], o[8 * h + 2][1], o[8 * h + 3][1]);
            d[3] = make_float4(o[8 * h + 4][1], o[8 * h + 5][1], o[8 * h + 6][1], o[8 * h + 7][1]);
        }
    }
    __syncthreads();
    if (tid < GROUP) {
        const int h = tid;
        float m = -INFINITY;
#pragma unroll
        for (int w = 0; w < NUM_WARPS; ++w) m = fmaxf(m, wm[w * GROUP + h]);
        float l = 0.f;
#pragma unroll
        for (int w = 0; w < NUM_WARPS; ++w) {
            const float mw = wm[w * GROUP + h];
            const float c = mw == -INFINITY ? 0.f : __expf(mw - m);
            wm[w * GROUP + h] = c;
            l += c * wl[w * GROUP + h];
        }
        hm[h] = m;
        hm[GROUP + h] = l;
    }
    __syncthreads();
    const int splits = t.dim(O::part_o, 3);
    const size_t part = ((size_t)b * kv_heads + g) * splits + sp;
    float* po = t.ptr<float>(O::part_o) + part * GROUP * HEAD_DIM;
    for (int i = tid; i < GROUP * HEAD_DIM; i += NUM_THREADS) {
        const int h = i / HEAD_DIM;
        float acc = 0.f;
#pragma unroll
        for (int w = 0; w < NUM_WARPS; ++w) acc += wm[w * GROUP + h] * wo[(w * GROUP + h) * ATTW_O_LD + i % HEAD_DIM];
        po[i] = acc;
        if (i % HEAD_DIM == 0) {
            float* ml = t.ptr<float>(O::part_ml) + (part * GROUP + h) * 2;
            ml[0] = hm[h];
            ml[1] = hm[GROUP + h];
        }
    }
}

__device__ void op_attn_split(const Task& t, unsigned char* smem) {
    if constexpr (ATT_WARP) {
        attn_split_warps(t, smem);
        return;
    }
    using O = OPND_ATTN_SPLIT;
    using A = ARG_ATTN_SPLIT;
    const int b = t.arg(A::seq), g = t.arg(A::kv_head), sp = t.arg(A::split);
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int pos = s_split_pos;  // read while warp 0 waited (prefetch_weights)
#if MKC_PAGED
    const int kv_heads = t.dim(O::k_cache, 4);
    int lo, hi;
    attn_key_range(t, pos, lo, hi);
    const KvRows krows = kv_rows<O>(t, O::k_cache, b, g), vrows = kv_rows<O>(t, O::v_cache, b, g);
#else
    const int ctx = t.dim(O::k_cache, 2), kv_heads = t.dim(O::k_cache, 3);
    int lo, hi;
    attn_key_range(t, pos, lo, hi);
    const size_t row0 = ((size_t)b * kv_heads + g) * ctx;
    const bf16* kc = t.ptr<bf16>(O::k_cache) + row0 * HEAD_DIM;
    const bf16* vc = t.ptr<bf16>(O::v_cache) + row0 * HEAD_DIM;
#endif

    bf16* qx = reinterpret_cast<bf16*>(smem);     // [8][HEAD_DIM + XS_PAD] q heads, the MMA's B operand
    float* gred = reinterpret_cast<float*>(smem + ATT_QX_BYTES);  // [ATT_GRED_FLOATS]
    float* qs = gred + ATT_GRED_FLOATS;           // [GROUP][HEAD_DIM], pre-scaled (CUDA-core path)
    float* sc = qs + GROUP * HEAD_DIM;            // [GROUP][ATT_CHUNK] scores, then probabilities
    float* red = sc + GROUP * ATT_CHUNK;          // [ATT_KL][HEAD_DIM] (ATT_RED_FLOATS)
    float* st_m = red + ATT_RED_FLOATS;           // [GROUP] running max
    float* st_l = st_m + GROUP;                   // [GROUP] running sum
    float* st_a = st_l + GROUP;                   // [GROUP] rescale of this pass
    bf16* vs = reinterpret_cast<bf16*>(smem + ATT_VS_OFF);  // [ATT_CHUNK][HEAD_DIM]

    // this step's key and value where the split rotates its own query (a qkv operand) and holds the
    // step's position: they come from qkv, not from the cache (ROPE_APPEND writes it after the splits)
    const bool fused = t.has(O::qkv);
    const int own = fused && lo <= pos && pos < hi ? pos : -1;  // the key taken from qkv (-1: none)
    // fused: red holds [GROUP + 2][HEAD_DIM] q heads, k (rotated), v until the last chunk is done
    const bf16* own_k = reinterpret_cast<const bf16*>(red) + GROUP * HEAD_DIM;
    const bf16* own_v = own_k + HEAD_DIM;
    if (fused) stage_own_query(t, b, g, pos, own >= 0, qx, qs, reinterpret_cast<bf16*>(red));
    else {
        const bf16* q = t.ptr<bf16>(O::q) + (size_t)b * t.dim(O::q, 1) + (size_t)g * GROUP * HEAD_DIM;
        if constexpr (ATT_MMA) stage_x(qx, q, HEAD_DIM, 0, HEAD_DIM, GROUP);
        else
            for (int i = tid; i < GROUP * HEAD_DIM; i += NUM_THREADS) qs[i] = ld_act_bf16(q + i) * ATTN_SCALE;
    }
    if (tid < GROUP) { st_m[tid] = -INFINITY; st_l[tid] = 0.f; }
    __syncthreads();

    const int dc = tid % ATT_DC, kl = tid / ATT_DC;
    float o[GROUP][8];
#pragma unroll
    for (int h = 0; h < GROUP; ++h)
#pragma unroll
        for (int e = 0; e < 8; ++e) o[h][e] = 0.f;

#if MKC_PAGED
    // chunks of at most ATT_CHUNK keys that never cross a page; kc / vc: row c0 (rows contiguous)
    for (int c0 = lo, n = 0; c0 < hi; c0 += n) {
        n = min(min(ATT_CHUNK, hi - c0), krows.run(c0));
        const int c1 = c0 + n;  // the next chunk, asked of L2 while this one is processed
        if (c1 < hi && tid < 2 * ATT_CHUNK * HEAD_DIM * 2 / 4096) {
            const int half = ATT_CHUNK * HEAD_DIM * 2 / 4096;
            const int nb = min(min(ATT_CHUNK, hi - c1), krows.run(c1)) * HEAD_DIM * 2;
            const int off = (tid % half) * 4096;
            if (off < nb)
                prefetch_l2(reinterpret_cast<const char*>(tid < half ? krows.row(c1) : vrows.row(c1)) + off,
                            (u32)min(4096, nb - off));
        }
        const bf16* kc = krows.row(c0) - (size_t)c0 * HEAD_DIM;  // so that kc + c0 * HEAD_DIM is row c0
        const bf16* vc = vrows.row(c0) - (size_t)c0 * HEAD_DIM;
#else
    for (int c0 = lo; c0 < hi; c0 += ATT_CHUNK) {
        const int n = min(ATT_CHUNK, hi - c0);
        // ask L2 for the next chunk's K and V rows while this one is processed (before the wait the
        // task asked for one row of each, ops.cuh: prefetch_weights)
        if (c0 + ATT_CHUNK < hi && tid < 2 * ATT_CHUNK * HEAD_DIM * 2 / 4096) {
            const int half = ATT_CHUNK * HEAD_DIM * 2 / 4096;  // 4 KB pieces of one chunk of K (or V)
            const int nb = min(ATT_CHUNK, hi - c0 - ATT_CHUNK) * HEAD_DIM * 2;  // bytes of the next chunk
            const int off = (tid % half) * 4096;
            if (off < nb)
                prefetch_l2(reinterpret_cast<const char*>((tid < half ? kc : vc) + (size_t)(c0 + ATT_CHUNK) * HEAD_DIM) + off,
                            (u32)min(4096, nb - off));
        }
#endif
        // this chunk's V: each thread copies the pieces it reads in P.V
        for (int j = kl; j < n; j += ATT_KL) {
            if (c0 + j == own) *reinterpret_cast<uint4*>(vs + (size_t)j * HEAD_DIM + dc * 8) =
                                   *reinterpret_cast<const uint4*>(own_v + dc * 8);
            else cp_async16(vs + (size_t)j * HEAD_DIM + dc * 8, vc + (size_t)(c0 + j) * HEAD_DIM + dc * 8);
        }
        if constexpr (ATT_MMA) {  // scores on the tensor cores: key rows x the group's query heads
            const bf16* const kw[1] = {kc + (size_t)c0 * HEAD_DIM};
            auto epi = [&](int r0, float (&acc)[1][4]) {
                for_fragment(r0, acc[0], n, [&](int key, int h, float v) { sc[h * ATT_CHUNK + key] = v * ATTN_SCALE; },
                             GROUP);
            };
            gemv_tile<1, decltype(epi), false>(kw, HEAD_DIM, n, HEAD_DIM, qx, gred, epi);
        } else if (tid < n) {  // scores on the CUDA cores: one key per thread
            const bool mine = c0 + tid == own;  // this step's key, rotated in shared memory
            const bf16* kr = kc + (size_t)(c0 + tid) * HEAD_DIM;
            float s[GROUP];
#pragma unroll
            for (int h = 0; h < GROUP; ++h) s[h] = 0.f;
#pragma unroll
            for (int c = 0; c < ATT_DC; ++c) {
                float kf[8];
                unpack8(mine ? *reinterpret_cast<const uint4*>(own_k + c * 8) : ld_act16(kr + c * 8), kf);
#pragma unroll
                for (int h = 0; h < GROUP; ++h) {
                    const float4 qa = *reinterpret_cast<const float4*>(qs + h * HEAD_DIM + c * 8);
                    const float4 qb = *reinterpret_cast<const float4*>(qs + h * HEAD_DIM + c * 8 + 4);
                    s[h] += qa.x * kf[0] + qa.y * kf[1] + qa.z * kf[2] + qa.w * kf[3] + qb.x * kf[4] +
                            qb.y * kf[5] + qb.z * kf[6] + qb.w * kf[7];
                }
            }
#pragma unroll
            for (int h = 0; h < GROUP; ++h) sc[h * ATT_CHUNK + tid] = s[h];
        }
        __syncthreads();
        // online softmax statistics, one warp per head
        for (int h = warp; h < GROUP; h += NUM_WARPS) {
            if (ATT_MMA && own >= c0 && own < c0 + n) {  // this step's key: its score from the rotated row
                float d = 0.f;
                for (int i = lane; i < HEAD_DIM; i += 32)
                    d = __fmaf_rn(__bfloat162float(qx[h * xs_ld(HEAD_DIM) + i]), __bfloat162float(own_k[i]), d);
                d = warp_sum(d);
                if (lane == 0) sc[h * ATT_CHUNK + own - c0] = d * ATTN_SCALE;
                __syncwarp();
            }
            float mx = -INFINITY;
            for (int j = lane; j < n; j += 32) mx = fmaxf(mx, sc[h * ATT_CHUNK + j]);
            mx = warp_max(mx);
            const float m_old = st_m[h], m_new = fmaxf(m_old, mx);
            float sum = 0.f;
            for (int j = lane; j < n; j += 32) {
                const float p = __expf(sc[h * ATT_CHUNK + j] - m_new);
                sc[h * ATT_CHUNK + j] = p;
                sum += p;
            }
            sum = warp_sum(sum);
            if (lane == 0) {
                const float alpha = __expf(m_old - m_new);
                st_a[h] = alpha;
                st_l[h] = st_l[h] * alpha + sum;
                st_m[h] = m_new;
            }
        }
        __syncthreads();
        // P.V: lane (kl, dc) accumulates keys kl, kl + ATT_KL, ... over its 8 columns
#pragma unroll
        for (int h = 0; h < GROUP; ++h) {
            const float a = st_a[h];
#pragma unroll
            for (int e = 0; e < 8; ++e) o[h][e] *= a;
        }
        cp_async_wait_all();  // only this thread's own pieces: no barrier
#pragma unroll 8
        for (int j = kl; j < n; j += ATT_KL) {
            float vf[8];
            unpack8(*reinterpret_cast<const uint4*>(vs + (size_t)j * HEAD_DIM + dc * 8), vf);
#pragma unroll
            for (int h = 0; h < GROUP; ++h) {
                const float p = sc[h * ATT_CHUNK + j];
#pragma unroll
                for (int e = 0; e < 8; ++e) o[h][e] += p * vf[e];
            }
        }
        __syncthreads();
    }

    // reduce the key lanes (fixed order) and write the partials
    const int splits = t.dim(O::part_o, 3);
    float* po = t.ptr<float>(O::part_o) + (((size_t)b * kv_heads + g) * splits + sp) * GROUP * HEAD_DIM;
    // every head at once, behind one barrier (the loop ended with one)
    float* pr = reinterpret_cast<float*>(vs);  // [GROUP][ATT_KL][HEAD_DIM]
#pragma unroll
    for (int h = 0; h < GROUP; ++h) {
        float4* r = reinterpret_cast<float4*>(pr + (h * ATT_KL + kl) * HEAD_DIM + dc * 8);
        r[0] = make_float4(o[h][0], o[h][1], o[h][2], o[h][3]);
        r[1] = make_float4(o[h][4], o[h][5], o[h][6], o[h][7]);
    }
    __syncthreads();
    for (int i = tid; i < GROUP * HEAD_DIM; i += NUM_THREADS) {
        const float* src = pr + (i / HEAD_DIM) * ATT_KL * HEAD_DIM + i % HEAD_DIM;
        float acc = 0.f;
        for (int k = 0; k < ATT_KL; ++k) acc += src[k * HEAD_DIM];
        po[i] = acc;
    }
    if (tid < GROUP) {
        float* ml = t.ptr<float>(O::part_ml) + ((((size_t)b * kv_heads + g) * splits + sp) * GROUP + tid) * 2;
        ml[0] = st_m[tid];
        ml[1] = st_l[tid];
    }
}

// attn[b, heads h0 .. h0 + nh of group g] = the splits' partials merged: o = sum_s c_s o_s with
// c_s = exp(m_s - m) / sum_s' exp(m_s' - m) l_s'. Phase 1: one warp per (token, head) turns the
// split statistics into the weights c_s. Phase 2: every thread sums a subset of the splits of one
// 16-byte output piece, with all its loads in flight; the subsets are then added in a fixed order.
__device__ void op_attn_combine(const Task& t, unsigned char* smem) {
    using O = OPND_ATTN_COMBINE;
    using A = ARG_ATTN_COMBINE;
    const int g = t.arg(A::kv_head), h0 = t.arg(A::head0), nh = t.arg(A::heads), splits = t.arg(A::splits);
    const int kv_heads = t.dim(O::part_o, 4);
    const float* po = t.ptr<float>(O::part_o);
    const float* pml = t.ptr<float>(O::part_ml);
    float* coef = reinterpret_cast<float*>(smem);  // [BATCH][nh][splits]: m_s, then the weights c_s
    float4* red = reinterpret_cast<float4*>(smem + (BATCH * nh * splits * 4 + 15) / 16 * 16);  // [parts][items]
    constexpr int HQ = HEAD_DIM / 4;  // 16-byte pieces of one head's output
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    for (int i = warp; i < BATCH * nh; i += NUM_WARPS) {
        const int b = i / nh, h = h0 + i % nh;
        const float* ml = pml + (((size_t)b * kv_heads + g) * splits * GROUP + h) * 2;
        float m_lane = -INFINITY, l_lane = 0.f;
#pragma unroll 4
        for (int s = lane; s < splits; s += 32) {
            const float2 v = __ldcg(reinterpret_cast<const float2*>(ml + (size_t)s * GROUP * 2));
            coef[i * splits + s] = v.x;
            if (v.x != -INFINITY) {  // an empty split (m = -inf, l = 0) weighs nothing
                const float mn = fmaxf(m_lane, v.x);
                l_lane = l_lane * __expf(m_lane - mn) + v.y * __expf(v.x - mn);
                m_lane = mn;
            }
        }
        const float m = warp_max(m_lane);
        const float l = warp_sum(m_lane == -INFINITY ? 0.f : l_lane * __expf(m_lane - m));
        const float inv = 1.f / l;
        __syncwarp();
        for (int s = lane; s < splits; s += 32) {
            const float ms = coef[i * splits + s];
            coef[i * splits + s] = ms == -INFINITY ? 0.f : __expf(ms - m) * inv;
        }
    }
    __syncthreads();
    const int items = BATCH * nh * HQ, parts = max(1, NUM_THREADS / items);
    bf16* out = t.ptr<bf16>(O::out);
    const int out_ld = t.dim(O::out, 1);
    const auto store = [&](int item, const float4& acc) {
        const int b = item / (nh * HQ), hq = item % (nh * HQ);
        uint2 o;
        o.x = pack_bf16x2(acc.x, acc.y);
        o.y = pack_bf16x2(acc.z, acc.w);
        *reinterpret_cast<uint2*>(out + (size_t)b * out_ld + (size_t)(g * GROUP + h0) * HEAD_DIM + hq * 4) = o;
    };
    for (int it = threadIdx.x; it < items * parts; it += NUM_THREADS) {
        const int item = it % items, part = it / items;
        const int b = item / (nh * HQ), hh = (item / HQ) % nh, quad = item % HQ;
        const float4* src = reinterpret_cast<const float4*>(
            po + (((size_t)b * kv_heads + g) * splits * GROUP + h0 + hh) * HEAD_DIM) + quad;
        const float* cf = coef + (b * nh + hh) * splits;
        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 4
        for (int s = part; s < splits; s += parts) {
            const float4 v = __ldcg(src + (size_t)s * (GROUP * HEAD_DIM / 4));
            const float cs = cf[s];
            acc.x += cs * v.x;
            acc.y += cs * v.y;
            acc.z += cs * v.z;
            acc.w += cs * v.w;
        }
        if (parts == 1) store(item, acc);
        else red[part * items + item] = acc;
    }
    if (parts == 1) return;
    __syncthreads();
    for (int item = threadIdx.x; item < items; item += NUM_THREADS) {
        float4 acc = red[item];
        for (int p = 1; p < parts; ++p) {
            const float4 v = red[p * items + item];
            acc.x += v.x;
            acc.y += v.y;
            acc.z += v.z;
            acc.w += v.w;
        }
        store(item, acc);
    }
}
