// Device functions for every opcode except attention (attention.cuh). One function per Opcode,
// named op_<opcode in lower case>, called by the generated dispatch with the task view and the
// CTA's dynamic shared memory. Semantics: mkc/ir/ops.py and the lowering (mkc/ir/lower.py).
// Shapes come from the buffer table at run time; only model constants are compiled in.
#pragma once

// ---- prefetch before wait -----------------------------------------------------------------------
// While warp 0 waits for a task's inputs, the other warps ask L2 for the first row of the task's
// immutable weights (a budget of 0 bytes: one row; larger budgets measured slower), so its stream
// starts as soon as the wait ends. Expert tasks ask for their expert's first row once they have
// read the routing.

// rows x row_elems elements (row stride ld) from w, whole rows up to `budget` bytes, spread over
// `lanes` threads of which this is `me`.
template <class T>
__device__ __forceinline__ void prefetch_rows_by(const T* w, int rows, int row_elems, int ld, int budget, int me,
                                                 int lanes) {
    constexpr int CHUNK = 4096;
    const int row_bytes = row_elems * (int)sizeof(T);
    rows = min(rows, max(1, budget / row_bytes));
    if (row_elems == ld) {  // contiguous rows: one range, in 4 KB pieces
        const long long total = (long long)rows * row_bytes;
        for (long long off = (long long)me * CHUNK; off < total; off += (long long)lanes * CHUNK)
            prefetch_l2(reinterpret_cast<const char*>(w) + off, (u32)min((long long)CHUNK, total - off));
    } else {
        for (int r = me; r < rows; r += lanes) prefetch_l2(w + (size_t)r * ld, (u32)row_bytes);
    }
}

// by the waiting task's warps 1.. (warp 0 polls the counters)
template <class T>
__device__ __forceinline__ void prefetch_rows(const T* w, int rows, int row_elems, int ld, int budget) {
    prefetch_rows_by(w, rows, row_elems, ld, budget, (int)threadIdx.x - 32, NUM_THREADS - 32);
}

// by every thread of a running task
template <class T>
__device__ __forceinline__ void prefetch_rows_all(const T* w, int rows, int row_elems, int ld, int budget) {
    prefetch_rows_by(w, rows, row_elems, ld, budget, (int)threadIdx.x, NUM_THREADS);
}

__device__ __forceinline__ float silu(float v) { return v / (1.f + expf(-v)); }

__device__ __forceinline__ bf16* gemv_xs(unsigned char* smem) { return reinterpret_cast<bf16*>(smem); }

__device__ __forceinline__ float* gemv_red(unsigned char* smem) {
    return reinterpret_cast<float*>(smem + GEMV_XS_BYTES);
}
// after the reduction floats: the norm staging's scratch (NORM_SCRATCH_BYTES)
__device__ __forceinline__ unsigned char* gemv_scratch(unsigned char* smem) {
    return smem + GEMV_XS_BYTES + GEMV_RED_FLOATS * 4;
}

// REUSE_STAGED_NORM: which normed input xs holds, every column of it: the residual stream x and the
// norm weight that the task at queue index qi staged last; qi = -2: none. Set by thread 0 after the
// staging barrier of a normed GEMV over every column; read by the next task of the SM (ordered by
// the kernel loop's barriers). A task of any other kind leaves it, but its own queue index breaks
// the chain: only the very next task may use it, and no normed GEMV writes xs after its staging.
struct StagedNorm {
    const float* x;
    const bf16* w;
    int qi;
};
__shared__ StagedNorm s_staged_norm;

// Whether this task's normed input over columns [k0, k0 + k) is already in xs (the same for every
// thread until the task's staging barrier).
template <class O>
__device__ __forceinline__ bool norm_is_staged(const Task& t, int k0, int k) {
    return REUSE_STAGED_NORM && k0 == 0 && k == HIDDEN && s_staged_norm.qi == t.qi - 1 &&
           s_staged_norm.x == t.ptr<float>(O::x) && s_staged_norm.w == t.ptr<bf16>(O::norm);
}

// The reduction of a GEMV over its whole input: the weight's row, or (K_PADDED: a weight may be
// stored with zero columns up to whole 64-wide blocks) the input's width.
template <class O>
__device__ __forceinline__ int input_k(const Task& t) { return K_PADDED ? t.dim(O::x, 1) : t.dim(O::weight, 1); }

// Stage a GEMV's input columns [k0, k0 + k) in two halves around the issue of its first weight
// loads (gemv_tile's `finish`): the bf16 activations x [BATCH, x_ld], or, when the task has a norm
// operand, the RMSNorm of the f32 residual stream x (stage_norm_*).
template <class O>
__device__ __forceinline__ void stage_input_async(const Task& t, unsigned char* smem, int k0, int k) {
    if (t.has(O::norm)) {
        if (!norm_is_staged<O>(t, k0, k))
            stage_norm_async(t.ptr<float>(O::x), t.ptr<bf16>(O::norm), k0, k, gemv_scratch(smem));
    } else {
        stage_x_async(gemv_xs(smem), t.ptr<bf16>(O::x), t.dim(O::x, 1), k0, k);
    }
}

// The end of a GEMV's staging (gemv_tile's `finish`), called by every thread from a warp-dependent
// point inside gemv_tile: hence cta_barrier(). operator() first waits for this thread's own
// copies; landed() is the rest. The last barrier publishes xs (for a norm operand, the
// normalised rows, which stage_norm_finish computes after its own barrier).
template <class O>
struct StageFinish {
    const Task& t;
    unsigned char* smem;
    int k0, k;
    __device__ void landed() const {
        const bool normed = t.has(O::norm);
        const bool reused = normed && norm_is_staged<O>(t, k0, k);
        if (normed && !reused) stage_norm_finish(gemv_xs(smem), k0, k, gemv_scratch(smem));
        prof_staged();
        cta_barrier();
        // every thread has checked norm_is_staged before the barrier; the next task reads this
        if (REUSE_STAGED_NORM && threadIdx.x == 0 && normed && k0 == 0 && k == HIDDEN)
            s_staged_norm = {t.ptr<float>(O::x), t.ptr<bf16>(O::norm), t.qi};
    }
    __device__ void operator()() const {
        cp_async_wait_all();
        landed();
    }
};

// A LINEAR tile that ends a layer (LowerOptions.residual_in_o_proj: a residual operand) adds its
// rows' residual terms to its product: the residual stream, a dense MLP's output, then every
// routing slot's expert output, in that order. They are copied with its activations, into the
// RMSNorm staging's scratch (the tile has no norm operand) as [term][BATCH][rows] floats, so they
// land with the activations' copies instead of costing the epilogue a round trip
// (KernelConfig.residual_stage_bytes: render.py sized the scratch for the largest such tile and
// checked that rows and col0 are multiples of 4).
template <class O>
__device__ __forceinline__ void stage_residual_async(const Task&, unsigned char*) {}

struct ResidualTerms {
    const float* staged;  // [terms][BATCH][rows]; null: the tile does not end a layer
    int terms, rows;
};

// The epilogue of a tile that ends a layer, for one GEMV fragment (gemv_tile's epi: rows r0 and
// r0 + 8, tokens n and n + 1 of this lane; c as for_fragment reads it): out[n, r] = (((residual +
// product) + mlp) + slot 0) + slot 1 ... Inlined into the LINEAR GEMV (CodegenOptions.
// residual_epilogue): the tile runs with the LINEAR code out of the instruction cache, and a call
// waited for the function's code. Out of line, the fragment goes by value (an array by reference
// would go through local memory).
#if MKC_RESIDUAL_EPILOGUE_INLINE
__device__ __forceinline__
#else
__device__ __noinline__
#endif
void store_with_residual(float* out, int out_ld, ResidualTerms res, int r0, float c0, float c1, float c2, float c3) {
    const float c[4] = {c0, c1, c2, c3};
    for_fragment(r0, c, res.rows, [&](int r, int n, float v) {
        const float* p = res.staged + n * res.rows + r;
        float a = p[0] + v;
        for (int i = 1; i < res.terms; ++i) a += p[(size_t)i * BATCH * res.rows];
        out[(size_t)n * out_ld + r] = a;
    });
}

__device__ __forceinline__ ResidualTerms residual_terms(const Task& t, unsigned char* smem) {
    using O = OPND_LINEAR;
    if (!t.has(O::residual)) return {nullptr, 0, 0};
    const int terms = 1 + (t.has(O::mlp) ? 1 : 0) + (t.has(O::routed) ? t.dim(O::routed, 3) : 0);
    return {reinterpret_cast<const float*>(gemv_scratch(smem)), terms, t.arg(ARG_LINEAR::rows)};
}

// Inline (a call would wait for the weight loads in flight in registers first: the staging
// would no longer overlap them); a warp per (term, token), a lane per 16 bytes of its rows.
template <>
__device__ __forceinline__ void stage_residual_async<OPND_LINEAR>(const Task& t, unsigned char* smem) {
    using O = OPND_LINEAR;
    if (!t.has(O::residual)) return;
    const ResidualTerms rt = residual_terms(t, smem);
    const int col0 = t.arg(ARG_LINEAR::col0), hidden = t.dim(O::residual, 1), quads = rt.rows / 4;
    const int mlp = t.has(O::mlp) ? 1 : 0;
    float* dst = reinterpret_cast<float*>(gemv_scratch(smem));
    for (int tb = threadIdx.x / 32; tb < rt.terms * BATCH; tb += NUM_WARPS) {
        const int b = tb % BATCH, term = tb / BATCH;
        const float* src = term == 0 ? t.ptr<float>(O::residual)
                           : term < 1 + mlp ? t.ptr<float>(O::mlp)
                           : t.ptr<float>(O::routed) + (size_t)(term - 1 - mlp) * BATCH * hidden;
        src += (size_t)b * hidden + col0;
        for (int c = threadIdx.x % 32; c < quads; c += 32) cp_async16(dst + (size_t)tb * rt.rows + 4 * c, src + 4 * c);
    }
}

// rows [0, rows) of BATCH tokens, ld floats apart, set to zero (out of line: a rare path)
__device__ __noinline__ void zero_rows(float* out, int ld, int rows) {
    for (int i = threadIdx.x; i < BATCH * rows; i += NUM_THREADS) out[(size_t)(i / rows) * ld + i % rows] = 0.f;
}

// The end of staging for a LINEAR tile, which issues its first weight loads before waiting for
// its inputs: the wait (every thread), then the activations' copies, then StageFinish.
// The wait comes first: warp 0 may still have the next task's record in flight (the kernel loop),
// which its counter loads need not wait for. A profiled step of the phase-marking kernel
// (PROFILE_PHASES) marks the staging's parts in the routing's slots, which a LINEAR tile does not
// use (profile.staging_phases): every warp through the wait's barrier, thread 0's copies issued,
// thread 0's copies landed; the RMSNorm and the barrier follow (StageFinish::landed).
template <class O>
struct WaitStageFinish : StageFinish<O> {
    __device__ void operator()() const {
        const StageFinish<O>& s = *this;
        task_wait(s.t.w);
        prof_mark(PROF_OPENED);
        stage_input_async<O>(s.t, s.smem, s.k0, s.k);
        stage_residual_async<O>(s.t, s.smem);
        prof_mark(PROF_ROUTING);
        cp_async_wait_all();
        prof_mark(PROF_LOGITS);
        s.landed();
    }
    __device__ void landed() const { (*this)(); }
};

// The end of staging for an expert-down tile, which issues its first weight loads before its wait (from its record's wait `first` on: the routing's part may be behind it):
// the wait, then the hidden states' copies, then the barrier that publishes them.
struct WaitCopyFinish {
    const Task& t;
    bf16* xs;
    const bf16* h;
    int k, first;
    __device__ void operator()() const {
        task_wait(t.w, first);
        stage_x_async(xs, h, k, 0, k);
        cp_async_wait_all();
        prof_staged();
        cta_barrier();
    }
    __device__ void landed() const { (*this)(); }
};

// WaitCopyFinish over the columns [k0, k0 + k) of rows of h_ld elements (op_expert_down_split).
struct WaitCopySliceFinish {
    const Task& t;
    bf16* xs;
    const bf16* h;
    int h_ld, k0, k, first;
    __device__ void operator()() const {
        task_wait(t.w, first);
        stage_x_async(xs, h, h_ld, k0, k);
        cp_async_wait_all();
        prof_staged();
        cta_barrier();
    }
    __device__ void landed() const { (*this)(); }
};

// Element offset of the tile starting at (row0, k0) of a weight with k columns: row-major, or in
// tile order (row0 % 16 == 0 and k0 % 64 == 0, mkc/codegen/weight_tiles.py).
__device__ __forceinline__ size_t weight_tile_offset(int row0, int k0, int k) {
    return (size_t)row0 * k + (WEIGHTS_TILED ? 16 * k0 : k0);
}

// The scales of a GEMV tile over matrix e of an FP8 weight [E?, R, K] (gemv.cuh: WeightScales):
// row sets from rows r0[a] of the matrix, columns from k0.
template <int NACC>
__device__ __forceinline__ WeightScales<NACC> weight_scales(const Task& t, int operand, int e, const int (&r0)[NACC],
                                                            int k0) {
    WeightScales<NACC> sc;
    const int R = t.dim(operand, 2), K = t.dim(operand, 1);
    sc.k_blocks = (K + 127) / 128;
    sc.s = t.scales(operand) + (size_t)e * (WEIGHT_FORMAT == 2 ? (R + 127) / 128 * sc.k_blocks : R);
#pragma unroll
    for (int a = 0; a < NACC; ++a) sc.r0[a] = r0[a];
    sc.kb0 = k0 / 64;
    return sc;
}

// A GEMV tile's `finish` for weights W: with the tile's scales beside it for FP8 ones (gemv.cuh:
// WithScales), as it is for bf16 ones.
template <class W, int NACC, class Fin>
__device__ __forceinline__ auto with_scales(const Fin& finish, const Task& t, int operand, int e,
                                            const int (&r0)[NACC], int k0) {
    if constexpr (is_fp8<W>()) return WithScales<Fin, NACC>{finish, weight_scales<NACC>(t, operand, e, r0, k0)};
    else return finish;
}

// Element offset of the 8 elements at (row, col) (col % 8 == 0) of a [rows, k] matrix in tile
// order: block (row / 16, col / 64), piece 2 * (row % 16 / 8) + col % 64 / 32, lane 4 * (row % 8)
// + col % 32 / 8 (weight_tiles.tile_offset).
__device__ __forceinline__ size_t tile_order_offset(int row, int col, int k) {
    const int rr = row % 16, cc = col % 64;
    return ((size_t)(row / 16) * (k / 64) + col / 64) * 1024 + (2 * (rr / 8) + cc / 32) * 256 +
           (4 * (rr % 8) + cc % 32 / 8) * 8;
}

// x[b, :] = embed[tokens[b], :]   (the tokens first, then 16-byte rows with many loads in flight;
// an embedding tied to the LM head is stored in tile order: DT_BF16_TILES)
__device__ void op_embed(const Task& t, unsigned char* smem) {
    using O = OPND_EMBED;
    // the embedding's row: HIDDEN columns, stored with zero columns past them where it is the LM
    // head's weight and K_PADDED
    const int hidden = K_PADDED ? HIDDEN : t.dim(O::embed, 1), chunks = hidden / 8, emb_ld = t.dim(O::embed, 1);
    const bf16* emb = t.ptr<bf16>(O::embed);
    const bool tiles = t.dtype(O::embed) == DT_BF16_TILES;
    int* tok = reinterpret_cast<int*>(smem);  // [BATCH]
    if (threadIdx.x < BATCH) tok[threadIdx.x] = __ldcg(t.ptr<int>(O::tokens) + threadIdx.x);
    __syncthreads();
    float* out = t.ptr<float>(O::out);
#pragma unroll 4
    for (int i = threadIdx.x; i < BATCH * chunks; i += NUM_THREADS) {
        const int b = i / chunks, c = i - b * chunks;
        float f[8];
        const size_t at = tiles ? tile_order_offset(tok[b], 8 * c, emb_ld) : (size_t)tok[b] * emb_ld + 8 * c;
        unpack8(__ldg(reinterpret_cast<const uint4*>(emb + at)), f);
        float4* o = reinterpret_cast<float4*>(out + (size_t)b * hidden + 8 * c);
        o[0] = make_float4(f[0], f[1], f[2], f[3]);
        o[1] = make_float4(f[4], f[5], f[6], f[7]);
    }
}

// ---- routing: recomputed by every task that needs it (mkc/ir/ops.py) ------------------------------
// From the router logits [BATCH, NUM_EXPERTS]: each token's top-k experts (the larger logit first,
// ties to the smaller expert, NaN as -inf), their weights (sigmoid of the logit, or the softmax
// over every expert; optionally renormalised over the top-k), the ascending list of distinct
// experts (slot s runs experts[s]) and each token's slots in ascending expert order. One warp per
// token picks its experts by TOP_K warp arg-max rounds over the logits held in registers.
constexpr int ROUTE_WORDS = (NUM_EXPERTS + 31) / 32;  // 32-expert words of a token's expert mask
struct Routing {
    int count;                     // distinct experts routed this step (the live slots)
    int experts[MOE_SLOTS];        // slot -> expert, ascending; -1 past count
    int sel[BATCH][TOP_K];         // each token's experts, best first
    float selw[BATCH][TOP_K];      // their routing weights
    int slots[BATCH][TOP_K];       // each token's slots, ascending expert order
    u32 mask[BATCH][ROUTE_WORDS];  // each token's experts as bits (expert 32 j + l: bit l of word j)
    u32 used[ROUTE_WORDS];         // the union of the masks
    int base[ROUTE_WORDS];         // slots of the experts below word j
    // token b's weight of expert e: 0 when b is not a token or did not pick e
    __device__ float weight(int b, int e) const {
        float w = 0.f;
        if (b < BATCH)
#pragma unroll
            for (int k = 0; k < TOP_K; ++k)
                if (sel[b][k] == e) w = selw[b][k];
        return w;
    }
};

// The router logits whose routing the Routing below holds (null at launch: the kernel sets it).
// A layer's logits are written once per step, and every caller of route_tokens has waited for
// them, so a later task of the same layer on this SM reuses the routing instead of deriving it
// again: an expert-down tile after an expert-up tile of its layer (the usual queue) skips the
// logits' round trip, the TOP_K arg-max rounds and its wait for the router tiles.
__shared__ const float* s_routed_logits;

__device__ __forceinline__ bool routing_known(const float* logits) { return s_routed_logits == logits; }

// TAGGED_LOGITS: one token's logits (a row of the router logits' tagged copy) into this lane's
// v[j] (expert lane + 32 j), read again with nanosleep backoff until every word carries this step.
// A tagged word is written once per step by the router tile that computes it, after that tile's own
// wait, so its step tag alone says the value is this step's. Bounded as wait_range is, by the same
// protocol (wait_verdict, record_abort): on a timeout the abort word names the task and the router
// tiles' counter (the record's first wait); on a timeout or another CTA's abort, lane 0 sets
// s_wait.abort and every lane returns false.
__device__ bool await_tagged_logits(const u64* row, float (&v)[ROUTE_WORDS], const int* rec) {
    const int lane = threadIdx.x % 32;
    const u32 step = s_wait.step;
    u64 t0 = 0;
    u32 sleep_ns = 32;
    for (u32 polls = 0;; ++polls) {
        bool ok = true;
#pragma unroll
        for (int j = 0; j < ROUTE_WORDS; ++j) {
            const int e = lane + 32 * j;
            v[j] = -INFINITY;
            if (e < NUM_EXPERTS) {
                const u64 w = ld_relaxed_gpu_u64(row + e);
                ok = ok && (u32)(w >> 32) == step;
                v[j] = __uint_as_float((u32)w);
            }
        }
        if (__all_sync(0xffffffffu, ok)) return true;
        if (polls == 0) t0 = global_timer_ns();
        __nanosleep(sleep_ns);
        sleep_ns = sleep_ns < 128 ? sleep_ns * 2 : 128;
        if ((polls & 31) == 31) {
            const int verdict = wait_verdict(s_wait.abort_info, t0, s_wait.timeout_ns, polls);
            if (verdict != 0) {
                if (lane == 0) {
                    const int c = rec[W_WAITS];  // the router tiles' counter (taskwords.encode)
                    if (verdict == 2)
                        record_abort(s_wait.abort_info, rec[W_ID], c,
                                     (u32)ld_relaxed_gpu_s32(reinterpret_cast<const int*>(s_wait.counters) + c),
                                     (u32)rec[W_WAITS + 1] * step);
                    s_wait.abort = 1;
                }
                __syncwarp();
                return false;
            }
        }
    }
}

// Token b's router logits into this lane's v[j] (expert lane + 32 j; -INFINITY past NUM_EXPERTS):
// from the tagged copy, read until every word carries this step (await_tagged_logits; false on a
// timeout or another CTA's abort, with s_wait.abort set), else from the logits the caller waited
// for. Called by all 32 lanes of one warp.
__device__ __forceinline__ bool token_logits(const float* logits, const u64* tagged, const int* rec, int b,
                                             float (&v)[ROUTE_WORDS]) {
    if (TAGGED_LOGITS && tagged) {
        if (!await_tagged_logits(tagged + b * NUM_EXPERTS, v, rec)) return false;
        prof_mark(PROF_LOGITS);  // every word carries this step (the counter path marks nothing)
        return true;
    }
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int j = 0; j < ROUTE_WORDS; ++j) {
        const int e = lane + 32 * j;
        v[j] = e < NUM_EXPERTS ? ld_act_f32(logits + b * NUM_EXPERTS + e) : -INFINITY;
    }
    return true;
}

// Token b's routing weights from its picked logits top (best first) and, for softmax scoring, its
// logits v (this lane's experts lane + 32 j): sigmoid of each pick, or the softmax over every
// expert (top[0] is the row maximum); renormalised over the picks where asked. Lane 0 writes them
// to r.selw[b]; called by all 32 lanes of one warp.
__device__ __forceinline__ void route_weights(Routing& r, int b, const float (&v)[ROUTE_WORDS], const float (&top)[TOP_K]) {
    const int lane = threadIdx.x % 32;
    float denom = 0.f;
    if (!ROUTER_SIGMOID) {
#pragma unroll
        for (int j = 0; j < ROUTE_WORDS; ++j)
            if (lane + 32 * j < NUM_EXPERTS) denom += expf(v[j] - top[0]);
        denom = warp_sum(denom);
    }
    if (lane == 0) {
        float w[TOP_K], sum = 0.f;
#pragma unroll
        for (int k = 0; k < TOP_K; ++k) {
            w[k] = ROUTER_SIGMOID ? 1.f / (1.f + expf(-top[k])) : expf(top[k] - top[0]) / denom;
            sum += w[k];
        }
#pragma unroll
        for (int k = 0; k < TOP_K; ++k) r.selw[b][k] = NORMALIZE_TOP_K ? w[k] / sum : w[k];
    }
}

// The distinct experts in ascending order, from every token's mask: a ballot prefix sum over their
// union (r.used, r.base, r.experts, r.count). Called by all 32 lanes of one warp.
__device__ __forceinline__ void route_distinct(Routing& r) {
    const int lane = threadIdx.x % 32;
    int n = 0;
    for (int j = 0; j < ROUTE_WORDS; ++j) {
        u32 m = 0;
#pragma unroll
        for (int b = 0; b < BATCH; ++b) m |= r.mask[b][j];
        if (lane == 0) { r.used[j] = m; r.base[j] = n; }
        if ((m >> lane) & 1u) r.experts[n + __popc(m & ((1u << lane) - 1u))] = 32 * j + lane;
        n += __popc(m);
    }
    for (int s = n + lane; s < MOE_SLOTS; s += 32) r.experts[s] = -1;
    if (lane == 0) r.count = n;
}

// ROUTING_RANK: one 64-bit key per (token, expert): the logit as an order-preserving integer (NaN
// as -inf, -0 as +0) above the complemented expert index, so a larger key is a better expert and
// ties go to the lower index, as better() orders them. Experts past NUM_EXPERTS (padding to whole
// words) have key 0, below every real key.
constexpr int ROUTE_LANES = ROUTE_WORDS * 32;
__shared__ __align__(16) u64 s_route_keys[ROUTING_RANK ? BATCH : 1][ROUTE_LANES];

__device__ __forceinline__ u64 route_key(float v, int e) {
    return ((u64)order_key(v != v ? -INFINITY : v) << 32) | (u32)~e;
}
__device__ __forceinline__ float key_value(u64 key) {  // the logit of a key (+0 for -0)
    const u32 k = (u32)(key >> 32);
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

// ROUTING_RANK (CodegenOptions.routing_argmax = "rank"): every token's TOP_K experts with no
// dependent rounds. One warp per token reads its logits (the tagged copy: await_tagged_logits) into
// keys in shared memory; after a barrier every (token, expert) pair is one thread that counts the
// keys of its token above its own (broadcast loads), so an expert of rank < TOP_K writes itself to
// r.sel[b][rank] and its logit to r.selw[b][rank], and each warp's ballot of its 32 experts is a
// word of the token's mask. After a second barrier a warp per token derives the weights
// (route_weights, the same arithmetic as the rounds' path) while warp 0 lists the distinct experts.
// The same picks in the same order as the rounds. Returns false, every thread alike (it is read
// after the first barrier), when a tagged wait timed out (s_wait.abort); the caller leaves at once.
__device__ __forceinline__ bool rank_experts(Routing& r, const float* logits, const u64* tagged, const int* rec) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    for (int b = warp; b < BATCH; b += NUM_WARPS) {
        float v[ROUTE_WORDS];
        if (!token_logits(logits, tagged, rec, b, v)) continue;  // s_wait.abort is set
#pragma unroll
        for (int j = 0; j < ROUTE_WORDS; ++j) {
            const int e = lane + 32 * j;
            s_route_keys[b][e] = e < NUM_EXPERTS ? route_key(v[j], e) : 0ull;
        }
    }
    __syncthreads();
    if (TAGGED_LOGITS && tagged && s_wait.abort) return false;
    // BATCH * ROUTE_LANES is whole warps, so every warp's lanes share a token and a mask word
    for (int p = threadIdx.x; p < BATCH * ROUTE_LANES; p += NUM_THREADS) {
        const int b = p / ROUTE_LANES, e = p % ROUTE_LANES;
        const u64 key = s_route_keys[b][e];
        const ulonglong2* row = reinterpret_cast<const ulonglong2*>(s_route_keys[b]);
        int rank = 0;
#pragma unroll 8
        for (int i = 0; i < ROUTE_LANES / 2; ++i) {
            const ulonglong2 o = row[i];
            rank += (o.x > key ? 1 : 0) + (o.y > key ? 1 : 0);
        }
        const bool picked = e < NUM_EXPERTS && rank < TOP_K;
        if (picked) {
            r.sel[b][rank] = e;
            r.selw[b][rank] = key_value(key);  // the picked logit, until its weight replaces it
        }
        const u32 m = __ballot_sync(0xffffffffu, picked);
        if (lane == 0) r.mask[b][e / 32] = m;
    }
    __syncthreads();
    prof_mark(PROF_RANKED);
    // token b's weights by warp b + 1 (mod NUM_WARPS), leaving warp 0 the distinct experts first
    for (int b = (warp + NUM_WARPS - 1) % NUM_WARPS; b < BATCH; b += NUM_WARPS) {
        float v[ROUTE_WORDS], top[TOP_K];
#pragma unroll
        for (int j = 0; j < ROUTE_WORDS; ++j) {
            const int e = lane + 32 * j;
            v[j] = e < NUM_EXPERTS ? key_value(s_route_keys[b][e]) : -INFINITY;
        }
#pragma unroll
        for (int k = 0; k < TOP_K; ++k) top[k] = r.selw[b][k];
        __syncwarp();  // every lane has its picks' logits before lane 0 overwrites them
        route_weights(r, b, v, top);
    }
    if (warp == 0) route_distinct(r);
    return true;
}

// Called by every thread of the CTA (it synchronises); the result lives in shared memory until
// the next call for other logits. The TOP_K arg-max rounds are a loop (the picked logits go
// through shared memory).
//
// With `tagged` (TAGGED_LOGITS, an expert-up tile: the logits' tagged copy) each warp reads its
// tokens' logits from the tagged copy until every word carries this step (await_tagged_logits),
// instead of the caller waiting for the router tiles' counter before the logits are read.
// Out of line: one copy of the routing's code, shared by the expert tiles and the routing task.
__device__ __noinline__ const Routing& route_tokens(const float* logits, const u64* tagged = nullptr,
                                                    const int* rec = nullptr) {
    __shared__ Routing r;
    if (routing_known(logits)) {  // the same value for every thread (set behind barriers)
        prof_routed();
        return r;
    }
    prof_mark(PROF_ROUTING);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if constexpr (ROUTING_RANK) {
        if (!rank_experts(r, logits, tagged, rec)) return r;  // a tagged wait timed out: the caller leaves
    } else {
        for (int b = warp; b < BATCH; b += NUM_WARPS) {
            float v[ROUTE_WORDS];
            if (!token_logits(logits, tagged, rec, b, v)) continue;  // s_wait.abort is set
#pragma unroll
            for (int j = 0; j < ROUTE_WORDS; ++j) v[j] = v[j] != v[j] ? -INFINITY : v[j];
            u32 taken = 0;  // bit j: this lane's expert lane + 32 j is picked
            float top[TOP_K];
#pragma unroll 1
            for (int k = 0; k < TOP_K; ++k) {
                float bv = -INFINITY;
                int bi = 0x7fffffff;
#pragma unroll
                for (int j = 0; j < ROUTE_WORDS; ++j) {
                    const int e = lane + 32 * j;
                    if (e < NUM_EXPERTS && !((taken >> j) & 1u) && better(v[j], e, bv, bi)) { bv = v[j]; bi = e; }
                }
                warp_argmax_redux(bv, bi);
                if (bi % 32 == lane) taken |= 1u << (bi / 32);
                if (lane == 0) {
                    r.sel[b][k] = bi;
                    r.selw[b][k] = bv;  // the picked logit, until its weight replaces it
                }
            }
            // every lane the picked logits (the softmax's denominator needs top[0])
            __syncwarp();
#pragma unroll
            for (int k = 0; k < TOP_K; ++k) top[k] = r.selw[b][k];
            __syncwarp();
            route_weights(r, b, v, top);
            prof_mark(PROF_RANKED);
#pragma unroll
            for (int j = 0; j < ROUTE_WORDS; ++j) {
                const u32 m = __ballot_sync(0xffffffffu, (taken >> j) & 1u);
                if (lane == 0) r.mask[b][j] = m;
            }
        }
        __syncthreads();
        if (TAGGED_LOGITS && tagged && s_wait.abort) return r;  // a tagged wait timed out: the caller leaves
        if (warp == 0) route_distinct(r);
    }
    __syncthreads();
    if (threadIdx.x < BATCH * TOP_K) {  // token b's kk-th expert in ascending order, as a slot
        const int b = threadIdx.x / TOP_K, kk = threadIdx.x % TOP_K;
        int seen = 0;
        for (int j = 0; j < ROUTE_WORDS; ++j) {
            u32 m = r.mask[b][j];
            const int c = __popc(m);
            if (kk < seen + c) {
                for (int skip = kk - seen; skip > 0; --skip) m &= m - 1u;  // drop the lower set bits
                const int l = __ffs(m) - 1;
                r.slots[b][kk] = r.base[j] + __popc(r.used[j] & ((1u << l) - 1u));
                break;
            }
            seen += c;
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) s_routed_logits = logits;  // read by later tasks, behind the kernel loop's barriers
    prof_routed();
    return r;
}

// The routing for the residual tiles and the host (route_tokens: the expert tiles compute the
// same values themselves): token_slots[b] (ascending expert), selected[b] (best first).
__device__ void op_topk(const Task& t, unsigned char*) {
    using O = OPND_TOPK;
    const Routing& rt = route_tokens(t.ptr<float>(O::logits));
    if (threadIdx.x < BATCH * TOP_K) {
        t.ptr<int>(O::token_slots)[threadIdx.x] = (&rt.slots[0][0])[threadIdx.x];
        t.ptr<int>(O::selected)[threadIdx.x] = (&rt.sel[0][0])[threadIdx.x];
    }
}

// The GEMV of a LINEAR tile; `finish` ends the staging of its activations (gemv_tile).
template <class W, class Fin>
__device__ __forceinline__ void linear_gemv(const Task& t, unsigned char* smem, Fin finish) {
    using O = OPND_LINEAR;
    using A = ARG_LINEAR;
    const int row0 = t.arg(A::row0), rows = t.arg(A::rows), k0 = t.arg(A::k0), k = t.arg(A::k);
    const int col0 = t.arg(A::col0), slab = t.arg(A::slab);
    bf16* xs = gemv_xs(smem);
    const int w_ld = t.dim(O::weight, 1);
    const W* const w[1] = {t.ptr<W>(O::weight) + weight_tile_offset(row0, k0, w_ld)};
    const int out_ld = t.dim(O::out, 1);
    const size_t base = (size_t)slab * t.dim(O::out, 2) * out_ld + col0;
    // TAGGED_LOGITS: the router tiles' logits (DT_F32_TAGGED) also go to their tagged copy, each
    // with this step, for the expert-up tiles that read them without waiting for this tile's counter
    u64* const tagged = TAGGED_LOGITS ? t.tagged(O::out) : nullptr;
    const u32 step = s_wait.step;
    const ResidualTerms res = residual_terms(t, smem);  // a tile that ends a layer (f32 out)
    // one instantiation, the output dtype a branch in the epilogue
    const bool f32 = t.dtype(O::out) != DT_BF16;
    float* out32 = t.ptr<float>(O::out) + base;
    bf16* out16 = t.ptr<bf16>(O::out) + base;
    gemv_tile<1>(w, w_ld, rows, k, xs, gemv_red(smem), [&](int r0, float (&acc)[1][4]) {
        if (res.staged) {
            store_with_residual(out32, out_ld, res, r0, acc[0][0], acc[0][1], acc[0][2], acc[0][3]);
            return;
        }
        for_fragment(r0, acc[0], rows, [&](int r, int n, float v) {
            const size_t i = (size_t)n * out_ld + r;
            if (f32) out32[i] = v;
            else store_bf16(out16 + i, v);
            if (TAGGED_LOGITS && tagged) st_relaxed_gpu_u64(tagged + base + i, tag_value(v, step));
        });
    }, with_scales<W, 1>(finish, t, O::weight, 0, {row0}, k0));
}

// out[slab, b, col0 + i] = sum_k x[b, k0 + k] * w[row0 + i, k0 + k]   (out bf16 or f32)
__device__ void op_linear(const Task& t, unsigned char* smem) {
    using O = OPND_LINEAR;
    using A = ARG_LINEAR;
    const int k0 = t.arg(A::k0), k = t.arg(A::k);
    // the kernel loop has not waited: the first weights fly first
    if constexpr (WEIGHT_FORMAT != 0) {
        if (t.dtype(O::weight) == DT_FP8_TILES) {  // a model's routers stay bf16
            linear_gemv<fp8e4>(t, smem, WaitStageFinish<O>{{t, smem, k0, k}});
            return;
        }
    }
    linear_gemv<bf16>(t, smem, WaitStageFinish<O>{{t, smem, k0, k}});
}

// The SwiGLU GEMVs' epilogue: out[tok * out_ld + r] = bf16(silu(gate) * up) for the rows r < rows
// and tokens of a finished 16-row group (gemv_tile's epi with two row sets: gate, up).
struct SwigluStore {
    bf16* out;
    int out_ld, rows;
    __device__ __forceinline__ void operator()(int r0, float (&acc)[2][4]) const {
        const int n = 2 * (threadIdx.x % 4);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int r = r0 + (i >= 2 ? 8 : 0), tok = n + (i & 1);
            if (r < rows && tok < BATCH) store_bf16(out + (size_t)tok * out_ld + r, silu(acc[0][i]) * acc[1][i]);
        }
    }
};

// h[b, col0 + i] = silu(x . w[row0 + i]) * (x . w[up_row0 + i])   (out bf16)
__device__ void op_swiglu(const Task& t, unsigned char* smem) {
    using O = OPND_SWIGLU;
    using A = ARG_SWIGLU;
    const int row0 = t.arg(A::row0), rows = t.arg(A::rows), up0 = t.arg(A::up_row0), col0 = t.arg(A::col0);
    const int k = input_k<O>(t);
    bf16* xs = gemv_xs(smem);
    stage_input_async<O>(t, smem, 0, k);
    const StageFinish<O> finish{t, smem, 0, k};
    const int w_ld = t.dim(O::weight, 1);
    const wt* wb = t.ptr<wt>(O::weight);
    const wt* const w[2] = {wb + (size_t)row0 * w_ld, wb + (size_t)up0 * w_ld};
    bf16* out = t.ptr<bf16>(O::out) + col0;
    const int out_ld = t.dim(O::out, 1);
    if constexpr (is_fp8<wt>())
        gemv_tile<2>(w, w_ld, rows, k, xs, gemv_red(smem), SwigluStore{out, out_ld, rows},
                     with_scales<wt, 2>(finish, t, O::weight, 0, {row0, up0}, 0));
    else
        gemv_tile<2>(w, w_ld, rows, k, xs, gemv_red(smem), SwigluStore{out, out_ld, rows}, finish);
}

// The opening of an expert gate/up tile (EXPERT_SWIGLU, EXPERT_MLP): its input's copies fly
// while the routing is derived (a no-op slot leaves them to the kernel loop's cp.async wait). With
// TAGGED_LOGITS the kernel loop did not wait for the router tiles (the record's first wait): the
// routing reads the logits' tagged copy until it holds this step's (the caller checks
// s_wait.abort).
//
// With `beside` (NORM_BESIDE_ROUTING, a normed input) warps 1.. copy and normalise the input
// themselves (stage_norm_beside_routing) before joining the routing, while warp 0 reads the logits
// and runs the arg-max rounds: at batch 1 the routing is warp 0's work alone, so the RMSNorm no
// longer follows it. The routing's first barrier (or, where it was known, the GEMV's finish:
// NormedBeside) publishes the rows. It always stages (a staged input left by the task before,
// REUSE_STAGED_NORM, is not looked for) and leaves s_staged_norm as it was.
template <class O>
__device__ __forceinline__ void stage_norm_beside_routing(const Task& t, unsigned char* smem, int k) {
    if (threadIdx.x < 32) return;
    stage_norm_async(t.ptr<float>(O::x), t.ptr<bf16>(O::norm), 0, k, gemv_scratch(smem), 1);
    cp_async_wait_all();
    stage_norm_finish(gemv_xs(smem), 0, k, gemv_scratch(smem), 1);
}

template <class O>
__device__ __forceinline__ const Routing& open_expert_up(const Task& t, unsigned char* smem, int k, bool beside = false) {
    prof_mark(PROF_OPENED);
    if (beside) stage_norm_beside_routing<O>(t, smem, k);
    else stage_input_async<O>(t, smem, 0, k);
    return route_tokens(t.ptr<float>(O::logits), TAGGED_LOGITS ? t.tagged(O::logits) : nullptr, t.w);
}

// The end of an expert gate/up tile's staging with NORM_BESIDE_ROUTING: where warps 1.. normalised
// the input during the routing, one barrier publishes it (the routing's own barriers may not have
// run: routing_known); else StageFinish.
template <class O>
struct NormedBeside : StageFinish<O> {
    bool beside;
    __device__ void landed() const {
        if (!beside) {
            StageFinish<O>::landed();
            return;
        }
        prof_staged();
        cta_barrier();
    }
    __device__ void operator()() const {
        if (!beside) cp_async_wait_all();
        landed();
    }
};

// h[slot, b, row0 + i] = silu(x . Wg[e, row0 + i]) * (x . Wu[e, row0 + i]), e = the expert of
// routing slot `slot`; a no-op when slot >= count (this step routed to fewer distinct experts).
__device__ void op_expert_swiglu(const Task& t, unsigned char* smem) {
    using O = OPND_EXPERT_SWIGLU;
    using A = ARG_EXPERT_SWIGLU;
    const int slot = t.arg(A::slot), row0 = t.arg(A::row0), rows = t.arg(A::rows);
    const int k = input_k<O>(t), inter2 = t.dim(O::weight, 2), w_ld = t.dim(O::weight, 1);
    const bool beside = NORM_BESIDE_ROUTING && t.has(O::norm);
    const Routing& rt = open_expert_up<O>(t, smem, k, beside);
    if (TAGGED_LOGITS && s_wait.abort) return;
    if (slot >= rt.count) return;
    const int e = rt.experts[slot];
    const wt* we = t.ptr<wt>(O::weight) + (size_t)e * inter2 * w_ld;
    const wt* const w[2] = {we + (size_t)row0 * w_ld, we + (size_t)(inter2 / 2 + row0) * w_ld};
    // the routed expert is known only now: ask L2 for the first row of both row sets at once
    prefetch_rows_all(w[0], rows, k, w_ld, 0);
    prefetch_rows_all(w[1], rows, k, w_ld, 0);
    bf16* xs = gemv_xs(smem);
    const int out_ld = t.dim(O::out, 1);
    bf16* out = t.ptr<bf16>(O::out) + (size_t)slot * t.dim(O::out, 2) * out_ld + row0;
    const int sets[2] = {row0, inter2 / 2 + row0};
    if constexpr (NORM_BESIDE_ROUTING) {
        const NormedBeside<O> finish{{t, smem, 0, k}, beside};
        gemv_tile<2>(w, w_ld, rows, k, xs, gemv_red(smem), SwigluStore{out, out_ld, rows},
                     with_scales<wt, 2>(finish, t, O::weight, e, sets, 0));
    } else {
        const StageFinish<O> finish{t, smem, 0, k};
        gemv_tile<2>(w, w_ld, rows, k, xs, gemv_red(smem), SwigluStore{out, out_ld, rows},
                     with_scales<wt, 2>(finish, t, O::weight, e, sets, 0));
    }
}

// The fused expert tile (LowerOptions.fused_experts): h = silu(x . Wg[e, rows]) * (x . Wu[e, rows])
// for its intermediate rows [row0, row0 + rows), rounded to bf16 as an expert-up tile stores it but
// kept in shared memory, then out[slot * parts + part, b, :] = weight(b, e) * (h[b] . Wd[e, :, rows]),
// the rows' split-K share of the down projection (exact zeros for a token that did not pick e, and
// for every token of a slot past the live count); the tile that ends the layer sums the parts. The
// down projection's weights stream right after the gate and up rows, with no hand-off between.
// FUSED_DOWN_BLOCKS = rows / 64 (the same for every fused tile; 0: the schedule has none, and the
// op compiles to nothing).
__device__ void op_expert_mlp(const Task& t, unsigned char* smem) {
    if constexpr (FUSED_DOWN_BLOCKS > 0) {
        using O = OPND_EXPERT_MLP;
        using A = ARG_EXPERT_MLP;
        constexpr int ROWS = 64 * FUSED_DOWN_BLOCKS;
        const int slot = t.arg(A::slot), row0 = t.arg(A::row0), part = t.arg(A::part);
        const int k = input_k<O>(t), inter2 = t.dim(O::weight, 2), w_ld = t.dim(O::weight, 1);
        const int inter = t.dim(O::down, 1), hidden = t.dim(O::down, 2);
        float* out = t.ptr<float>(O::out) + (size_t)(slot * (inter / ROWS) + part) * BATCH * hidden;
        const Routing& rt = open_expert_up<O>(t, smem, k);
        if (TAGGED_LOGITS && s_wait.abort) return;
        if (slot >= rt.count) {
            zero_rows(out, hidden, hidden);
            return;
        }
        const int e = rt.experts[slot];
        const bf16* we = t.ptr<bf16>(O::weight) + (size_t)e * inter2 * w_ld;
        const bf16* const w[2] = {we + (size_t)row0 * w_ld, we + (size_t)(inter2 / 2 + row0) * w_ld};
        // h: the down projection's B operand, in the RMSNorm's scratch (normalised into xs by now);
        // its token rows >= BATCH are never written, and only feed output columns nobody reads
        bf16* hs = reinterpret_cast<bf16*>(gemv_scratch(smem));
        const StageFinish<O> finish{t, smem, 0, k};
        gemv_tile<2>(w, w_ld, ROWS, k, gemv_xs(smem), gemv_red(smem), SwigluStore{hs, xs_ld(ROWS), ROWS}, finish);
        cta_barrier();
        const int n0 = 2 * (threadIdx.x % 4);
        const float wt0 = rt.weight(n0, e), wt1 = rt.weight(n0 + 1, e);
        const bf16* wd = t.ptr<bf16>(O::down) + (size_t)e * hidden * inter + weight_tile_offset(0, row0, inter);
        gemv_short_k<FUSED_DOWN_BLOCKS>(wd, inter, hidden, hs, [&](int r0, float (&acc)[1][4]) {
            for_fragment(r0, acc[0], hidden, [&](int r, int n, float v) {
                const float wt = (n & 1) ? wt1 : wt0;
                out[(size_t)n * hidden + r] = wt != 0.f ? wt * v : 0.f;
            });
        });
    }
}

// out[slot, b, row0 + i] = weight(b, e) * (h[slot, b] . Wd[e, row0 + i]), e = the expert of
// routing slot `slot`; a no-op when slot >= count. The task waits itself, in two parts: first the
// routing (mkc/codegen/taskwords.py lists the router's counter first for EXPERT_DOWN), which names
// the expert, so the tile issues its first weight batch before it waits for the hidden states; a
// no-op slot waits for nothing more. Where this SM already holds the layer's
// routing (routing_known) the tile skips the first part and waits for everything in one pass once
// its weights are on the way.
__device__ void op_expert_down(const Task& t, unsigned char* smem) {
    using O = OPND_EXPERT_DOWN;
    using A = ARG_EXPERT_DOWN;
    const int slot = t.arg(A::slot), row0 = t.arg(A::row0), rows = t.arg(A::rows);
    const int k = t.dim(O::h, 1), tokens = t.dim(O::h, 2);
    bf16* xs = gemv_xs(smem);
    const bf16* h = t.ptr<bf16>(O::h) + (size_t)slot * tokens * k;
    const float* logits = t.ptr<float>(O::logits);
    const bool routed = routing_known(logits);
    if (!routed) task_wait(t.w, 0, 1);
    const Routing& rt = route_tokens(logits);
    if (slot >= rt.count) {
        if (routed) task_wait(t.w, 0, 1);  // nothing to wait for, but the profile records the wait
        // zeros, so a sum over every slot (a LINEAR tile that ends the layer) stays right
        zero_rows(t.ptr<float>(O::out) + (size_t)slot * t.dim(O::out, 2) * t.dim(O::out, 1) + row0, t.dim(O::out, 1), rows);
        return;
    }
    const int e = rt.experts[slot];
    // this lane's two tokens' routing weights of expert e (0 where a token did not pick it)
    const int n0 = 2 * (threadIdx.x % 4);
    const float wt0 = rt.weight(n0, e), wt1 = rt.weight(n0 + 1, e);
    const int w_ld = t.dim(O::weight, 1), w_rows = t.dim(O::weight, 2);
    const wt* const w[1] = {t.ptr<wt>(O::weight) + ((size_t)e * w_rows + row0) * w_ld};
    const int out_ld = t.dim(O::out, 1);
    float* out = t.ptr<float>(O::out) + (size_t)slot * t.dim(O::out, 2) * out_ld + row0;
    const auto epi = [&](int r0, float (&acc)[1][4]) {
        for_fragment(r0, acc[0], rows, [&](int r, int n, float v) {
            // exact zeros for a token that did not pick e (a sum over every slot reads them)
            const float wt = (n & 1) ? wt1 : wt0;
            out[(size_t)n * out_ld + r] = wt != 0.f ? wt * v : 0.f;
        });
    };
    // the first weight batch is issued by gemv_tile before the rest of the wait
    gemv_tile<1>(w, w_ld, rows, k, xs, gemv_red(smem), epi,
                 with_scales<wt, 1>(WaitCopyFinish{t, xs, h, k, routed ? 0 : 1}, t, O::weight, e, {row0}, 0));
}

// op_expert_down over the columns [k0, k0 + k) of the slot's hidden state only, into out[slab]:
// the K split of an expert whose intermediate size does not fit the shared memory (a split-K
// partial, summed by the tile that ends the layer). Waits in two parts, as op_expert_down. Empty
// unless EXPERT_DOWN_K_SPLIT.
__device__ void op_expert_down_split(const Task& t, unsigned char* smem) {
    if constexpr (EXPERT_DOWN_K_SPLIT) {
        using O = OPND_EXPERT_DOWN_SPLIT;
        using A = ARG_EXPERT_DOWN_SPLIT;
        const int slot = t.arg(A::slot), row0 = t.arg(A::row0), rows = t.arg(A::rows);
        const int k0 = t.arg(A::k0), k = t.arg(A::k), slab = t.arg(A::slab);
        const int h_ld = t.dim(O::h, 1), tokens = t.dim(O::h, 2);
        bf16* xs = gemv_xs(smem);
        const bf16* h = t.ptr<bf16>(O::h) + (size_t)slot * tokens * h_ld;
        const float* logits = t.ptr<float>(O::logits);
        const bool routed = routing_known(logits);
        if (!routed) task_wait(t.w, 0, 1);
        const Routing& rt = route_tokens(logits);
        const int out_ld = t.dim(O::out, 1);
        float* out = t.ptr<float>(O::out) + (size_t)slab * t.dim(O::out, 2) * out_ld + row0;
        if (slot >= rt.count) {
            if (routed) task_wait(t.w, 0, 1);  // nothing to wait for, but the profile records the wait
            zero_rows(out, out_ld, rows);  // zeros, so the sum over every partial stays right
            return;
        }
        const int e = rt.experts[slot];
        const int n0 = 2 * (threadIdx.x % 4);
        const float wt0 = rt.weight(n0, e), wt1 = rt.weight(n0 + 1, e);
        const int w_ld = t.dim(O::weight, 1), w_rows = t.dim(O::weight, 2);
        const wt* const w[1] = {t.ptr<wt>(O::weight) + (size_t)e * w_rows * w_ld +
                                weight_tile_offset(row0, k0, w_ld)};
        const auto epi = [&](int r0, float (&acc)[1][4]) {
            for_fragment(r0, acc[0], rows, [&](int r, int n, float v) {
                const float wt = (n & 1) ? wt1 : wt0;
                out[(size_t)n * out_ld + r] = wt != 0.f ? wt * v : 0.f;
            });
        };
        gemv_tile<1>(w, w_ld, rows, k, xs, gemv_red(smem), epi,
                     with_scales<wt, 1>(WaitCopySliceFinish{t, xs, h, h_ld, k0, k, routed ? 0 : 1}, t, O::weight, e,
                                        {row0}, k0));
    }
}

// logits[b, row0 + i] = LOGIT_SCALE * x[b] . w[row0 + i]; best_*[b, tile] = its arg-max
__device__ void op_lm_head(const Task& t, unsigned char* smem) {
    using O = OPND_LM_HEAD;
    using A = ARG_LM_HEAD;
    const int row0 = t.arg(A::row0), rows = t.arg(A::rows), tile = t.arg(A::tile);
    const int k = input_k<O>(t);
    bf16* xs = gemv_xs(smem);
    stage_input_async<O>(t, smem, 0, k);
    const StageFinish<O> finish{t, smem, 0, k};
    const int w_ld = t.dim(O::weight, 1);
    const wt* const w[1] = {t.ptr<wt>(O::weight) + (size_t)row0 * w_ld};
    const int out_ld = t.dim(O::logits, 1);
    float* out = t.ptr<float>(O::logits) + row0;
    float bv[2] = {-INFINITY, -INFINITY};
    int bi[2] = {0x7fffffff, 0x7fffffff};
    gemv_tile<1>(w, w_ld, rows, k, xs, gemv_red(smem), [&](int r0, float (&acc)[1][4]) {
        for_fragment(r0, acc[0], rows, [&](int r, int n, float v) {
            v *= LOGIT_SCALE;
            out[(size_t)n * out_ld + r] = v;
            const int j = n & 1;
            if (better(v, row0 + r, bv[j], bi[j])) { bv[j] = v; bi[j] = row0 + r; }
        });
    }, with_scales<wt, 1>(finish, t, O::weight, 0, {row0}, 0));
    // reduce over the 8 lanes sharing a token pair, then over warps
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int o = 4; o < 32; o <<= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, bv[j], o);
            const int oi = __shfl_xor_sync(0xffffffffu, bi[j], o);
            if (better(ov, oi, bv[j], bi[j])) { bv[j] = ov; bi[j] = oi; }
        }
    __syncthreads();  // gemv_red may still be read by the k-split reduction
    float* sv = gemv_red(smem);                          // [NUM_WARPS][8]
    int* si = reinterpret_cast<int*>(sv + NUM_WARPS * 8);  // [NUM_WARPS][8]
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane < 4) {
#pragma unroll
        for (int j = 0; j < 2; ++j) { sv[warp * 8 + 2 * lane + j] = bv[j]; si[warp * 8 + 2 * lane + j] = bi[j]; }
    }
    __syncthreads();
    if (threadIdx.x < BATCH) {
        const int n = threadIdx.x;
        float v = sv[n];
        int i = si[n];
        for (int wp = 1; wp < NUM_WARPS; ++wp)
            if (better(sv[wp * 8 + n], si[wp * 8 + n], v, i)) { v = sv[wp * 8 + n]; i = si[wp * 8 + n]; }
        const int tiles = t.dim(O::best_val, 1);
        t.ptr<float>(O::best_val)[n * tiles + tile] = v;
        t.ptr<int>(O::best_idx)[n * tiles + tile] = i;
    }
}

// next_token[b] = arg-max over the LM-head tiles' partials (ties: the smaller vocabulary index)
__device__ void op_argmax(const Task& t, unsigned char*) {
    using O = OPND_ARGMAX;
    const int tiles = t.dim(O::best_val, 1);
    const float* bv = t.ptr<float>(O::best_val);
    const int* bi = t.ptr<int>(O::best_idx);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    for (int b = warp; b < BATCH; b += NUM_WARPS) {
        float v = -INFINITY;
        int i = 0x7fffffff;
        for (int j = lane; j < tiles; j += 32) {
            const float ov = ld_act_f32(bv + b * tiles + j);
            const int oi = ld_act_i32(bi + b * tiles + j);
            if (better(ov, oi, v, i)) { v = ov; i = oi; }
        }
        warp_argmax(v, i);
        if (lane == 0) t.ptr<int>(O::out)[b] = i;
    }
}

// [q =] rope(qk_norm(q)), k = rope(qk_norm(k)) of KV head g for every sequence; k and v appended at
// positions[b]. Without a q operand (LowerOptions.rope_in_splits: the splits rotate q themselves)
// only k and v. The arithmetic of each element is rope_pair's (attention.cuh), as in the splits.
constexpr int ROPE_RINV_OFF = 128;  // rope_append's shared memory: positions, qk-norm factors, rows
constexpr int ROPE_ROWS_OFF = ROPE_RINV_OFF + (BATCH * (GROUP + 1) * 4 + 127) / 128 * 128;

__device__ void op_rope_append(const Task& t, unsigned char* smem) {
    using O = OPND_ROPE_APPEND;
    using A = ARG_ROPE_APPEND;
    const int g = t.arg(A::kv_head);
    const bool rope = t.arg(A::rope) != 0;
    const bool qk_norm = t.has(O::q_norm), with_q = t.has(O::q);
    const int qkv_ld = t.dim(O::qkv, 1);
#if MKC_PAGED
    const int kv_heads = t.dim(O::k_cache, 4);
#else
    const int ctx = t.dim(O::k_cache, 2), kv_heads = t.dim(O::k_cache, 3);
#endif
    const int q_heads = qkv_ld / HEAD_DIM - 2 * kv_heads;
    constexpr int HALF = HEAD_DIM / 2, CH = HEAD_DIM / 8;
    constexpr int ROWS = GROUP + 2;  // GROUP query heads, the key head, the value head
    const bf16* qkv = t.ptr<bf16>(O::qkv);
    // shared memory: positions [BATCH], qk-norm factors [BATCH][GROUP + 1], the rows [BATCH][ROWS][HEAD_DIM]
    int* pos_s = reinterpret_cast<int*>(smem);
    float* rinv = reinterpret_cast<float*>(smem + ROPE_RINV_OFF);
    bf16* rows_s = reinterpret_cast<bf16*>(smem + ROPE_ROWS_OFF);
    // one round trip: every position and every 16-byte piece of the rows in flight together
    if (threadIdx.x < BATCH) pos_s[threadIdx.x] = __ldcg(t.ptr<int>(O::positions) + threadIdx.x);
#pragma unroll 4
    for (int i = threadIdx.x; i < BATCH * ROWS * CH; i += NUM_THREADS) {
        const int b = i / (ROWS * CH), j = (i / CH) % ROWS, c = i % CH;
        if (j < GROUP && !with_q) continue;
        const int head = j < GROUP ? g * GROUP + j : (j == GROUP ? q_heads + g : q_heads + kv_heads + g);
        const uint4* src = reinterpret_cast<const uint4*>(qkv + (size_t)b * qkv_ld + (size_t)head * HEAD_DIM);
        reinterpret_cast<uint4*>(rows_s)[i] = __ldcg(src + c);
    }
    __syncthreads();
    if (qk_norm) {
        const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
        for (int r = warp; r < BATCH * (GROUP + 1); r += NUM_WARPS) {
            if (r % (GROUP + 1) < GROUP && !with_q) continue;
            const float v = head_rinv(rows_s + ((r / (GROUP + 1)) * ROWS + r % (GROUP + 1)) * HEAD_DIM, lane);
            if (lane == 0) rinv[r] = v;
        }
        __syncthreads();
    }
    const bf16* qn = t.ptr<bf16>(O::q_norm);
    const bf16* kn = t.ptr<bf16>(O::k_norm);
    for (int i = threadIdx.x; i < BATCH * ROWS * HALF; i += NUM_THREADS) {
        const int b = i / (ROWS * HALF), j = (i / HALF) % ROWS, p = i % HALF;
        if (j < GROUP && !with_q) continue;
        const int pos = pos_s[b];
        const bf16* src = rows_s + (b * ROWS + j) * HEAD_DIM;
        bf16* dst;
#if MKC_PAGED
        if (j < GROUP) dst = t.ptr<bf16>(O::q) + (size_t)b * t.dim(O::q, 1) + (size_t)(g * GROUP + j) * HEAD_DIM;
        else dst = const_cast<bf16*>(kv_rows<O>(t, j == GROUP ? O::k_cache : O::v_cache, b, g).row(pos));
#else
        const size_t cache_row = (((size_t)b * kv_heads + g) * ctx + pos) * HEAD_DIM;
        if (j < GROUP) dst = t.ptr<bf16>(O::q) + (size_t)b * t.dim(O::q, 1) + (size_t)(g * GROUP + j) * HEAD_DIM;
        else if (j == GROUP) dst = t.ptr<bf16>(O::k_cache) + cache_row;
        else dst = t.ptr<bf16>(O::v_cache) + cache_row;
#endif
        float a, c;
        int ia, ib;
        const bool norm_rotate = j <= GROUP;  // the value row is copied as it is
        rope_pair(src, p, pos, rope && norm_rotate, qk_norm && norm_rotate ? (j < GROUP ? qn : kn) : nullptr,
                  qk_norm && norm_rotate ? rinv[b * (GROUP + 1) + j] : 1.f, a, c, ia, ib);
        store_bf16(dst + ia, a);
        store_bf16(dst + ib, c);
    }
}

// x_out[b, cols] = x + sum_g o_part[g, b] + mlp[0, b] + sum_k routed[token_slots[b, k], b]
// (token_slots in ascending expert order). The token slots come first, into shared memory (one
// round trip); then every term of an element is loaded before the first add, so an element costs
// one more round trip instead of one per slot (each routed term's address depends on its slot).
// The adds run in the order written above.
__device__ void op_residual(const Task& t, unsigned char*) {
    using O = OPND_RESIDUAL;
    using A = ARG_RESIDUAL;
    const int col0 = t.arg(A::col0), cols = t.arg(A::cols), parts = t.arg(A::o_parts);
    const int hidden = t.dim(O::x, 1);
    const float* x = t.ptr<float>(O::x);
    const float* op = t.ptr<float>(O::o_part);
    const float* mlp = t.ptr<float>(O::mlp);
    const float* routed = t.ptr<float>(O::routed);
    const int* ts = t.ptr<int>(O::token_slots);
    float* out = t.ptr<float>(O::out);
    constexpr int PARTS_IN_FLIGHT = 8;  // O-projection slices loaded at once (a loop past that)
    __shared__ int slots[BATCH * TOP_K];
    if (routed) {  // the same for every thread: the barrier below is uniform
        if (threadIdx.x < BATCH * TOP_K) slots[threadIdx.x] = ld_act_i32(ts + threadIdx.x);
        __syncthreads();
    }
    for (int i = threadIdx.x; i < BATCH * cols; i += NUM_THREADS) {
        const int b = i / cols, c = col0 + i % cols;
        const size_t bc = (size_t)b * hidden + c;
        const float xv = ld_act_f32(x + bc);
        float ov[PARTS_IN_FLIGHT];
#pragma unroll
        for (int g = 0; g < PARTS_IN_FLIGHT; ++g) ov[g] = g < parts ? ld_act_f32(op + (size_t)g * BATCH * hidden + bc) : 0.f;
        const float mv = mlp ? ld_act_f32(mlp + bc) : 0.f;
        float rv[TOP_K];
#pragma unroll
        for (int k = 0; k < TOP_K; ++k)
            rv[k] = routed ? ld_act_f32(routed + (size_t)slots[b * TOP_K + k] * BATCH * hidden + bc) : 0.f;
        float v = xv;
#pragma unroll
        for (int g = 0; g < PARTS_IN_FLIGHT; ++g)
            if (g < parts) v += ov[g];
        for (int g = PARTS_IN_FLIGHT; g < parts; ++g) v += ld_act_f32(op + (size_t)g * BATCH * hidden + bc);
        if (mlp) v += mv;
        if (routed)
#pragma unroll
            for (int k = 0; k < TOP_K; ++k) v += rv[k];
        out[bc] = v;
    }
}

// ---- prefetch before wait -----------------------------------------------------------------------
// (helpers at the top of this file)

// Called by warps 1.. of the CTA (warp 0 is waiting) before the task's counters are met.
__device__ void prefetch_weights(const Task& t) {
    switch (t.op()) {
        case OP_LINEAR: {
            using O = OPND_LINEAR;
            using A = ARG_LINEAR;
            const int ld = t.dim(O::weight, 1);
            if constexpr (WEIGHT_FORMAT != 0) {
                if (t.dtype(O::weight) == DT_FP8_TILES) {  // in tile order, as bf16's below
                    const fp8e4* w = t.ptr<fp8e4>(O::weight) + weight_tile_offset(t.arg(A::row0), t.arg(A::k0), ld);
                    prefetch_rows(w, (t.arg(A::rows) + 15) / 16, 16 * t.arg(A::k), 16 * ld, 0);
                    break;
                }
            }
            const bf16* w = t.ptr<bf16>(O::weight) + weight_tile_offset(t.arg(A::row0), t.arg(A::k0), ld);
            if (WEIGHTS_TILED)  // a run of 16 * k elements per 16-row group, groups 16 * ld apart
                prefetch_rows(w, (t.arg(A::rows) + 15) / 16, 16 * t.arg(A::k), 16 * ld, 0);
            else
                prefetch_rows(w, t.arg(A::rows), t.arg(A::k), ld, 0);
            break;
        }
        case OP_SWIGLU: {
            using O = OPND_SWIGLU;
            using A = ARG_SWIGLU;
            const int ld = t.dim(O::weight, 1);
            const wt* w = t.ptr<wt>(O::weight);
            prefetch_rows(w + (size_t)t.arg(A::row0) * ld, t.arg(A::rows), ld, ld, 0);
            prefetch_rows(w + (size_t)t.arg(A::up_row0) * ld, t.arg(A::rows), ld, ld, 0);
            break;
        }
        case OP_LM_HEAD: {
            using O = OPND_LM_HEAD;
            using A = ARG_LM_HEAD;
            const int ld = t.dim(O::weight, 1);
            prefetch_rows(t.ptr<wt>(O::weight) + (size_t)t.arg(A::row0) * ld, t.arg(A::rows), ld, ld, 0);
            break;
        }
        case OP_ATTN_SPLIT: {  // the split's K and V rows: written by earlier steps, and positions are inputs
            using O = OPND_ATTN_SPLIT;
            using A = ARG_ATTN_SPLIT;
            const int pos = split_position(t);
            if (threadIdx.x == 32) s_split_pos = pos;  // for the split (published by the loop's barrier)
            int lo, hi;
            attn_key_range(t, pos, lo, hi);
            const bool ring = ATT_WARP && t.has(O::qkv);
            if (ring)  // each warp's first blocks into its ring (attention.cuh)
                attw_prologue(attw_ring_lane(gemv_dyn_smem), attn_rows(t), lo, hi);
            // the query's RoPE table, once the copies are on their way
            if (t.has(O::qkv) && t.arg(A::rope)) rope_table(pos);
            if (ring) break;
            const int budget = 0;  // per cache: one row of each (more measured slower)
#if MKC_PAGED
            const KvRows krows = kv_rows<O>(t, O::k_cache, t.arg(A::seq), t.arg(A::kv_head));
            const KvRows vrows = kv_rows<O>(t, O::v_cache, t.arg(A::seq), t.arg(A::kv_head));
            for (int j = lo, left = budget; j < hi;) {  // page by page
                const int n = min(hi - j, krows.run(j));
                prefetch_rows(krows.row(j), n, HEAD_DIM, HEAD_DIM, left);
                prefetch_rows(vrows.row(j), n, HEAD_DIM, HEAD_DIM, left);
                j += n;
                left -= n * HEAD_DIM * 2;
                if (left <= 0) break;
            }
#else
            const size_t row0 = ((size_t)t.arg(A::seq) * t.dim(O::k_cache, 3) + t.arg(A::kv_head)) * t.dim(O::k_cache, 2);
            prefetch_rows(t.ptr<bf16>(O::k_cache) + (row0 + lo) * HEAD_DIM, hi - lo, HEAD_DIM, HEAD_DIM, budget);
            prefetch_rows(t.ptr<bf16>(O::v_cache) + (row0 + lo) * HEAD_DIM, hi - lo, HEAD_DIM, HEAD_DIM, budget);
#endif
            break;
        }
        default:
            break;
    }
}
