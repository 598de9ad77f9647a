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
// ATTN_STAGE_V: after the layout below (16-aligned), this chunk's V rows [ATT_CHUNK][HEAD_DIM] bf16;
// after the last chunk the same bytes hold every head's key-lane partials [GROUP][ATT_KL][HEAD_DIM]
// (mkc/codegen/render.py sizes it as the larger of the two)
constexpr int ATT_VS_OFF = (ATT_QX_BYTES + (ATT_GRED_FLOATS + GROUP * HEAD_DIM + GROUP * ATT_CHUNK +
                                            ATT_RED_FLOATS + 3 * GROUP) * 4 + 15) / 16 * 16;
constexpr int ATT_VS_BYTES = ATT_CHUNK * HEAD_DIM * 2 > GROUP * ATT_KL * HEAD_DIM * 4 ? ATT_CHUNK * HEAD_DIM * 2
                                                                                    : GROUP * ATT_KL * HEAD_DIM * 4;
// ATT_SMEM_K (CodegenOptions.attn_stage_k; the tensor-core Q.K and staged V only): after the V
// region, this chunk's K rows [ATT_CHUNK][ATT_KS_LD], the row padded by 16 bytes so that the A
// fragment loads of 8 rows x 4 lanes fall in 32 distinct banks. The first chunk of a split that
// rotates its own query is copied in while the task waits (ops.cuh: prefetch_weights): its rows
// were written by earlier steps, and the step's own row is replaced after the copy.
constexpr bool ATT_SMEM_K = ATTN_STAGE_K && ATTN_STAGE_V && ATT_MMA;
constexpr int ATT_KS_LD = HEAD_DIM + 8;
constexpr int ATT_KS_OFF = (ATT_VS_OFF + ATT_VS_BYTES + 15) / 16 * 16;
static_assert(!ATTN_STAGE_V || ATT_VS_OFF + ATT_VS_BYTES <= SMEM_BYTES, "attention: V chunk past the shared memory");
static_assert(!ATT_SMEM_K || ATT_KS_OFF + ATT_CHUNK * ATT_KS_LD * 2 <= SMEM_BYTES,
              "attention: K chunk past the shared memory (mkc/codegen/render.py sizes it)");

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
__device__ __forceinline__ void rope_pair(const bf16* row, int p, int pos, bool rope, const bf16* w, float r,
                                          float& oa, float& ob, int& ia, int& ib) {
    ia = ROPE_INTERLEAVED ? 2 * p : p;
    ib = ROPE_INTERLEAVED ? 2 * p + 1 : p + HEAD_DIM / 2;
    float a = __bfloat162float(row[ia]), c = __bfloat162float(row[ib]);
    if (w) {
        a = bf16_round(bf16_round(__fmul_rn(a, r)) * __bfloat162float(w[ia]));
        c = bf16_round(bf16_round(__fmul_rn(c, r)) * __bfloat162float(w[ib]));
    }
    if (rope) {
        float sn, cs;
        rope_sincos(pos, p, sn, cs);
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

// [lo, hi) of the keys this split attends (empty when lo >= hi)
__device__ __forceinline__ void attn_key_range(const Task& t, int& lo, int& hi) {
    using O = OPND_ATTN_SPLIT;
    using A = ARG_ATTN_SPLIT;
    const int pos = ld_act_i32(t.ptr<int>(O::positions) + t.arg(A::seq));
    const int window = t.arg(A::window), split_keys = t.arg(A::split_keys);
    const int base = window > 0 ? max(0, pos - window + 1) : 0;
    lo = base + t.arg(A::split) * split_keys;
    hi = min(pos + 1, lo + split_keys);
}

// cp.async the K rows (into ks, padded) and V rows (into vs) of a chunk of n contiguous rows
// starting at krow / vrow, pieces me, me + lanes, ...; each lands at its issuing thread's
// cp_async_wait_all (a barrier must follow before others read it).
__device__ __forceinline__ void attn_copy_chunk(bf16* ks, bf16* vs, const bf16* krow, const bf16* vrow, int n, int me,
                                                int lanes) {
    for (int i = me; i < n * ATT_DC; i += lanes) {
        const int j = i / ATT_DC, c = i % ATT_DC;
        cp_async16(ks + (size_t)j * ATT_KS_LD + c * 8, krow + (size_t)j * HEAD_DIM + c * 8);
        cp_async16(vs + (size_t)j * HEAD_DIM + c * 8, vrow + (size_t)j * HEAD_DIM + c * 8);
    }
}

// Scores of the chunk's keys [0, n) in ks against the query heads in qx (the B operand, 8 rows),
// on the tensor cores (keys as the 16 rows of A, heads as the 8 columns), scaled, into
// sc[h][key] for h < GROUP. Warp w takes the 16-key groups w, w + NUM_WARPS, ...
__device__ __forceinline__ void attn_scores_smem(const bf16* ks, const bf16* qx, int n, float* sc) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int qld = xs_ld(HEAD_DIM);
    for (int r0 = warp * 16; r0 < n; r0 += NUM_WARPS * 16) {
        float acc[4] = {0.f, 0.f, 0.f, 0.f};
        const bf16* lo = ks + (size_t)(r0 + g) * ATT_KS_LD + 2 * t;
        const bf16* hi = lo + 8 * ATT_KS_LD;
        const bf16* q = qx + g * qld + 2 * t;
#pragma unroll
        for (int k0 = 0; k0 < HEAD_DIM; k0 += 16) {
            mma_16816(acc, *reinterpret_cast<const u32*>(lo + k0), *reinterpret_cast<const u32*>(hi + k0),
                      *reinterpret_cast<const u32*>(lo + k0 + 8), *reinterpret_cast<const u32*>(hi + k0 + 8),
                      *reinterpret_cast<const u32*>(q + k0), *reinterpret_cast<const u32*>(q + k0 + 8));
        }
        for_fragment(r0 + g, acc, n, [&](int key, int h, float v) { sc[h * ATT_CHUNK + key] = v * ATTN_SCALE; },
                     GROUP);
    }
}

// A split with a qkv operand (LowerOptions.rope_in_splits) stages its query itself: the GROUP
// query heads of sequence b, KV group g from qkv, qk-norm (q_norm / k_norm operands) and RoPE as
// ROPE_APPEND computes them (rope_pair), rounded to bf16 as ROPE_APPEND stores them, into qx (the
// MMA's B operand, rows >= GROUP zero) or qs (scaled floats, CUDA-core path). With `own` (the
// split holds the step's position) also the key head, rotated in place, and the value head: both
// stay in `rows` ([GROUP + 2][HEAD_DIM] bf16, then [GROUP + 1] f32 qk-norm factors) for the chunks.
// Ends with a barrier.
__device__ void stage_own_query(const Task& t, int b, int g, bool own, bf16* qx, float* qs, bf16* rows) {
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
    const int pos = ld_act_i32(t.ptr<int>(O::positions) + b);
    const bf16* qn = t.ptr<bf16>(O::q_norm);
    const bf16* kn = t.ptr<bf16>(O::k_norm);
    for (int i = tid; i < nrot * HALF; i += NUM_THREADS) {
        const int j = i / HALF, p = i % HALF;
        float a, c;
        int ia, ib;
        rope_pair(rows + j * HEAD_DIM, p, pos, rope, qk_norm ? (j < GROUP ? qn : kn) : nullptr,
                  qk_norm ? rinv[j] : 1.f, a, c, ia, ib);
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

__device__ void op_attn_split(const Task& t, unsigned char* smem) {
    using O = OPND_ATTN_SPLIT;
    using A = ARG_ATTN_SPLIT;
    const int b = t.arg(A::seq), g = t.arg(A::kv_head), sp = t.arg(A::split);
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
#if MKC_PAGED
    const int kv_heads = t.dim(O::k_cache, 4);
    int lo, hi;
    attn_key_range(t, lo, hi);
    const KvRows krows = kv_rows<O>(t, O::k_cache, b, g), vrows = kv_rows<O>(t, O::v_cache, b, g);
#else
    const int ctx = t.dim(O::k_cache, 2), kv_heads = t.dim(O::k_cache, 3);
    int lo, hi;
    attn_key_range(t, lo, hi);
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
    bf16* vs = reinterpret_cast<bf16*>(smem + ATT_VS_OFF);  // ATTN_STAGE_V: [ATT_CHUNK][HEAD_DIM]
    bf16* ks = reinterpret_cast<bf16*>(smem + ATT_KS_OFF);  // ATT_SMEM_K: [ATT_CHUNK][ATT_KS_LD]

    // this step's key and value where the split rotates its own query (a qkv operand) and holds the
    // step's position: they come from qkv, not from the cache (ROPE_APPEND writes it after the splits)
    const bool fused = t.has(O::qkv);
    const int pos = ld_act_i32(t.ptr<int>(O::positions) + b);
    const int own = fused && lo <= pos && pos < hi ? pos : -1;  // the key taken from qkv (-1: none)
    // fused: red holds [GROUP + 2][HEAD_DIM] q heads, k (rotated), v until the last chunk is done
    const bf16* own_k = reinterpret_cast<const bf16*>(red) + GROUP * HEAD_DIM;
    const bf16* own_v = own_k + HEAD_DIM;
    if (fused) stage_own_query(t, b, g, own >= 0, qx, qs, reinterpret_cast<bf16*>(red));
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
        // task asked for ATTN_PREFETCH_BYTES of its rows, ops.cuh: prefetch_weights)
        if (c0 + ATT_CHUNK < hi && tid < 2 * ATT_CHUNK * HEAD_DIM * 2 / 4096) {
            const int half = ATT_CHUNK * HEAD_DIM * 2 / 4096;  // 4 KB pieces of one chunk of K (or V)
            const int nb = min(ATT_CHUNK, hi - c0 - ATT_CHUNK) * HEAD_DIM * 2;  // bytes of the next chunk
            const int off = (tid % half) * 4096;
            if (off < nb)
                prefetch_l2(reinterpret_cast<const char*>((tid < half ? kc : vc) + (size_t)(c0 + ATT_CHUNK) * HEAD_DIM) + off,
                            (u32)min(4096, nb - off));
        }
#endif
        if constexpr (ATT_SMEM_K) {  // this chunk's K and V in shared memory (Q.K reads K there)
            // the first chunk of a split rotating its own query was copied in while it waited
            if (!(fused && c0 == lo))
                attn_copy_chunk(ks, vs, kc + (size_t)c0 * HEAD_DIM, vc + (size_t)c0 * HEAD_DIM, n, tid, NUM_THREADS);
            cp_async_wait_all();
            __syncthreads();
            if (own >= c0 && own < c0 + n) {  // this step's key and value, from qkv, over the stale row
                for (int i = tid; i < 2 * ATT_DC; i += NUM_THREADS) {
                    const int c = i % ATT_DC;
                    if (i < ATT_DC) *reinterpret_cast<uint4*>(ks + (size_t)(own - c0) * ATT_KS_LD + c * 8) =
                                        *reinterpret_cast<const uint4*>(own_k + c * 8);
                    else *reinterpret_cast<uint4*>(vs + (size_t)(own - c0) * HEAD_DIM + c * 8) =
                             *reinterpret_cast<const uint4*>(own_v + c * 8);
                }
                __syncthreads();
            }
        } else if constexpr (ATTN_STAGE_V) {  // this chunk's V: each thread copies the pieces it reads in P.V
            for (int j = kl; j < n; j += ATT_KL) {
                if (c0 + j == own) *reinterpret_cast<uint4*>(vs + (size_t)j * HEAD_DIM + dc * 8) =
                                       *reinterpret_cast<const uint4*>(own_v + dc * 8);
                else cp_async16(vs + (size_t)j * HEAD_DIM + dc * 8, vc + (size_t)(c0 + j) * HEAD_DIM + dc * 8);
            }
        }
        if constexpr (ATT_SMEM_K) {
            attn_scores_smem(ks, qx, n, sc);
        } else if constexpr (ATT_MMA) {  // scores on the tensor cores: key rows x the group's query heads
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
            if (ATT_MMA && !ATT_SMEM_K && own >= c0 && own < c0 + n) {  // this step's key: its score from the rotated row
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
        if constexpr (ATTN_STAGE_V && !ATT_SMEM_K) cp_async_wait_all();  // only this thread's own pieces: no barrier
#pragma unroll 8
        for (int j = kl; j < n; j += ATT_KL) {
            float vf[8];
            unpack8(ATTN_STAGE_V     ? *reinterpret_cast<const uint4*>(vs + (size_t)j * HEAD_DIM + dc * 8)
                    : c0 + j == own ? *reinterpret_cast<const uint4*>(own_v + dc * 8)
                                     : ld_act16(vc + (size_t)(c0 + j) * HEAD_DIM + dc * 8), vf);
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
    if constexpr (ATTN_STAGE_V) {  // every head at once, behind one barrier (the loop ended with one)
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
    } else {  // head by head through one lane buffer
#pragma unroll
        for (int h = 0; h < GROUP; ++h) {
            float4* r = reinterpret_cast<float4*>(red + kl * HEAD_DIM + dc * 8);
            r[0] = make_float4(o[h][0], o[h][1], o[h][2], o[h][3]);
            r[1] = make_float4(o[h][4], o[h][5], o[h][6], o[h][7]);
            __syncthreads();
            for (int d = tid; d < HEAD_DIM; d += NUM_THREADS) {
                float acc = 0.f;
                for (int k = 0; k < ATT_KL; ++k) acc += red[k * HEAD_DIM + d];
                po[h * HEAD_DIM + d] = acc;
            }
            __syncthreads();
        }
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
// 16-byte output piece (all its loads in flight); the subsets are then added in a fixed order.
__device__ void op_attn_combine(const Task& t, unsigned char* smem) {
    using O = OPND_ATTN_COMBINE;
    using A = ARG_ATTN_COMBINE;
    const int g = t.arg(A::kv_head), h0 = t.arg(A::head0), nh = t.arg(A::heads), splits = t.arg(A::splits);
    const int kv_heads = t.dim(O::part_o, 4);
    const float* po = t.ptr<float>(O::part_o);
    const float* pml = t.ptr<float>(O::part_ml);
    float* coef = reinterpret_cast<float*>(smem);  // [BATCH][nh][splits]: m_s, then the weights c_s
    float4* red = reinterpret_cast<float4*>(smem + (BATCH * nh * splits * 4 + 15) / 16 * 16);  // [parts][items]
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
    constexpr int HQ = HEAD_DIM / 4;  // 16-byte pieces of one head's output
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
