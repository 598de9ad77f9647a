// Common device helpers of the mkc persistent decode kernel: types, loads, counters, the task view.
//
// Included by the rendered kernel after its constants (kernel.cu.j2); hand-written, model-agnostic.
// Memory-model contract (schedule.py): a producer makes its writes visible and then adds 1 to its
// counter with a release at GPU scope; a consumer acquire-loads the counter until it reaches
// target * step. Activations written by other SMs during this launch are read with ld.global.cg
// (L2, never a possibly stale L1 line); weights are immutable and take the non-coherent path.
#pragma once

#include <cuda_bf16.h>

typedef __nv_bfloat16 bf16;
typedef unsigned int u32;
typedef unsigned long long u64;

// One element of an FP8 (e4m3) weight matrix (WEIGHT_FORMAT > 0).
struct fp8e4 {
    unsigned char bits;
};
template <bool C, class A, class B> struct pick_type { using type = A; };
template <class A, class B> struct pick_type<false, A, B> { using type = B; };
// The element of the matrices a GEMV streams (a model's routers stay bf16 either way).
using wt = typename pick_type<WEIGHT_FORMAT == 0, bf16, fp8e4>::type;
template <class T> __host__ __device__ constexpr bool is_fp8() { return sizeof(T) == 1; }

#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif

// ---- loads and stores --------------------------------------------------------------------------

// An L2 cache policy that marks the lines a load brings in as the first to evict
// (WEIGHTS_EVICT_FIRST: bytes read once per step, so the lines warmed for later tiles stay).
__device__ __forceinline__ u64 l2_evict_first_policy() {
    u64 pol;
    asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
    return pol;
}

// 16 bytes of immutable weights, streamed: non-coherent path, no L1 allocation.
__device__ __forceinline__ uint4 ldg_stream(const void* p) {
    uint4 v;
    if constexpr (WEIGHTS_EVICT_FIRST)
        asm("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
            : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p), "l"(l2_evict_first_policy()));
    else
        asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
            : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

// 16 bytes of activations / KV written earlier in this launch (possibly by another SM).
__device__ __forceinline__ uint4 ld_act16(const void* p) {
    uint4 v;
    asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

__device__ __forceinline__ float ld_act_f32(const float* p) {
    float v;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
    return v;
}

__device__ __forceinline__ int ld_act_i32(const int* p) {
    int v;
    asm volatile("ld.global.cg.s32 %0, [%1];" : "=r"(v) : "l"(p));
    return v;
}

__device__ __forceinline__ float ld_act_bf16(const bf16* p) {
    unsigned short v;
    asm volatile("ld.global.cg.u16 %0, [%1];" : "=h"(v) : "l"(p));
    return __uint_as_float(((u32)v) << 16);
}

__device__ __forceinline__ uint4 lds16(const void* p) { return *reinterpret_cast<const uint4*>(p); }

__device__ __forceinline__ uint4 zero4() { return make_uint4(0u, 0u, 0u, 0u); }

// bf16 pair packed in a u32 (element 0 in the low half) to floats; exact.
__device__ __forceinline__ float bf_lo(u32 w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf_hi(u32 w) { return __uint_as_float(w & 0xffff0000u); }

// 8 bf16 (one 16-byte vector) to floats.
__device__ __forceinline__ void unpack8(const uint4& v, float (&f)[8]) {
    f[0] = bf_lo(v.x); f[1] = bf_hi(v.x); f[2] = bf_lo(v.y); f[3] = bf_hi(v.y);
    f[4] = bf_lo(v.z); f[5] = bf_hi(v.z); f[6] = bf_lo(v.w); f[7] = bf_hi(v.w);
}

__device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {
    const u32 l = __bfloat16_as_ushort(__float2bfloat16_rn(lo));
    const u32 h = __bfloat16_as_ushort(__float2bfloat16_rn(hi));
    return l | (h << 16);
}

// Four e4m3 (one u32, element 0 in the low byte) to two bf16 pairs (elements 0, 1 and 2, 3), exactly:
// the sign, exponent and mantissa bits placed into a bf16 give the value times 2^-120 (exponent
// bias 7 against 127; e4m3's subnormals land on bf16's), and one bf16x2 multiply by 2^120 restores
// it. Integer and FMA-pipe work only, no conversion unit.
__device__ __forceinline__ void e4m3x4_to_bf16(u32 w, u32& lo, u32& hi) {
    const u32 p0 = __byte_perm(w, 0u, 0x1404), p1 = __byte_perm(w, 0u, 0x3424);  // [0, b0, 0, b1], [0, b2, 0, b3]
    lo = (p0 & 0x80008000u) | ((p0 >> 4) & 0x07f007f0u);
    hi = (p1 & 0x80008000u) | ((p1 >> 4) & 0x07f007f0u);
    asm("mul.rn.bf16x2 %0, %0, %1;" : "+r"(lo) : "r"(0x7b807b80u));
    asm("mul.rn.bf16x2 %0, %0, %1;" : "+r"(hi) : "r"(0x7b807b80u));
}

__device__ __forceinline__ void store_bf16(bf16* p, float v) { *p = __float2bfloat16_rn(v); }

// v rounded to the nearest bf16, as a float
__device__ __forceinline__ float bf16_round(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }

// Ask L2 to fetch [p, p + bytes) (16-byte aligned, a multiple of 16): a hint, never a fault.
__device__ __forceinline__ void prefetch_l2(const void* p, u32 bytes) {
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
}

// 16-byte asynchronous copy global -> shared (both 16-byte aligned).
__device__ __forceinline__ void cp_async16(void* smem_dst, const void* gsrc) {
    const u32 d = (u32)__cvta_generic_to_shared(smem_dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d), "l"(gsrc) : "memory");
}

// The same for bytes read once per step (the KV cache's rows): with WEIGHTS_EVICT_FIRST their L2
// lines are the first to evict.
__device__ __forceinline__ void cp_async16_stream(void* smem_dst, const void* gsrc) {
    if constexpr (WEIGHTS_EVICT_FIRST) {
        const u32 d = (u32)__cvta_generic_to_shared(smem_dst);
        asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;" ::"r"(d), "l"(gsrc),
                     "l"(l2_evict_first_policy()) : "memory");
    } else {
        cp_async16(smem_dst, gsrc);
    }
}

__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }

// cp.async groups: commit this thread's uncommitted copies as one group; wait until at most N of
// its groups are still in flight (the older ones have landed).
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait_group() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

// CTA-wide barrier that threads may reach from different code locations (the non-.aligned form;
// __syncthreads() is bar.sync, which must be the same instruction in every thread): GEMV tiles
// finish their activations' staging inside the weight stream, at a warp-dependent point.
__device__ __forceinline__ void cta_barrier() { asm volatile("barrier.sync 0;" ::: "memory"); }

// The same among warps first_warp.. of the CTA alone (barrier 1; first_warp 0: cta_barrier). Warps
// 1.. of an expert gate/up tile normalise its input while warp 0 derives the routing
// (ops.cuh: stage_norm_beside_routing).
__device__ __forceinline__ void warps_barrier(int first_warp) {
    if (first_warp == 0) cta_barrier();
    else asm volatile("barrier.sync 1, %0;" ::"r"(NUM_THREADS - 32 * first_warp) : "memory");
}

// ---- counters ------------------------------------------------------------------------------------

__device__ __forceinline__ u32 ld_acquire_gpu(const u32* p) {
    u32 v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void red_release_gpu_add(u32* p, u32 v) {
    asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ int ld_relaxed_gpu_s32(const int* p) {
    int v;
    asm volatile("ld.relaxed.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// One 8-byte word, read and written whole (an aligned 64-bit access is single-copy atomic): a
// tagged value (tagged_copy) is the value's 32 bits and the step that wrote it.
__device__ __forceinline__ u64 ld_relaxed_gpu_u64(const u64* p) {
    u64 v;
    asm volatile("ld.relaxed.gpu.global.b64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void st_relaxed_gpu_u64(u64* p, u64 v) {
    asm volatile("st.relaxed.gpu.global.b64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ u64 tag_value(float v, u32 step) { return ((u64)step << 32) | __float_as_uint(v); }

__device__ __forceinline__ u64 global_timer_ns() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// counter >= need, robust to u32 wrap-around (counters only grow).
__device__ __forceinline__ bool reached(u32 value, u32 need) { return (int)(value - need) >= 0; }

// ---- warp reductions ----------------------------------------------------------------------------

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// (value, index) arg-max; ties and NaN-free order: larger value wins, then the smaller index.
__device__ __forceinline__ bool better(float v, int i, float bv, int bi) {
    return v > bv || (v == bv && i < bi);
}

__device__ __forceinline__ void warp_argmax(float& v, int& i) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, v, o);
        const int oi = __shfl_xor_sync(0xffffffffu, i, o);
        if (better(ov, oi, v, i)) { v = ov; i = oi; }
    }
}

// warp_argmax for values that are not NaN, in two warp reductions (redux.sync): the largest value
// as an order-preserving unsigned key (-0 counted as +0, as == does), then the lowest index among
// the lanes holding it; the value itself comes from the lane whose index won. Lane l's index must
// be congruent to l mod 32 or be 0x7fffffff (no candidate), as the routing's expert lane + 32 j is.
__device__ __forceinline__ u32 order_key(float v) {
    u32 u = __float_as_uint(v);
    if (u == 0x80000000u) u = 0u;  // -0 as +0
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ void warp_argmax_redux(float& v, int& i) {
    const u32 key = order_key(v);
    u32 best, at;
    asm("redux.sync.max.u32 %0, %1, 0xffffffff;" : "=r"(best) : "r"(key));
    asm("redux.sync.min.u32 %0, %1, 0xffffffff;" : "=r"(at) : "r"(key == best ? (u32)i : 0xffffffffu));
    v = __shfl_sync(0xffffffffu, v, (int)(at & 31u));
    i = (int)at;
}

// ---- the task view ------------------------------------------------------------------------------

// One buffer of the device pointer table (the host writes the same layout, see taskwords.py).
struct BufDesc {
    void* ptr;
    int shape[MAX_RANK];  // left-padded with 1s: shape[MAX_RANK - 1] is the innermost dim
    int dtype;            // DT_BF16 | DT_F32 | DT_I32 | DT_BF16_TILES (weights in tile order) | DT_F32_TAGGED
                          // | DT_FP8_TILES (e4m3 weights in tile order, their scales after them)
};

constexpr int MAX_OPERANDS = W_ARGS - W_OPERANDS;
static_assert(sizeof(BufDesc) == 32, "BufDesc layout is shared with mkc/codegen/taskwords.py");

struct Task {
    const int* w;            // this task's record (shared-memory copy)
    const BufDesc* d;        // its operands' buffer descriptors by role (shared-memory copy; absent: zeros)
    int qi;                  // the record's index in the queues (tasks of one SM are consecutive)

    __device__ __forceinline__ int op() const { return w[W_OP]; }
    __device__ __forceinline__ int arg(int i) const { return w[W_ARGS + i]; }
    __device__ __forceinline__ bool has(int operand) const { return w[W_OPERANDS + operand] >= 0; }
    __device__ __forceinline__ const BufDesc& buf(int operand) const {
        return d[operand];
    }
    template <class T>
    __device__ __forceinline__ T* ptr(int operand) const {
        return has(operand) ? reinterpret_cast<T*>(buf(operand).ptr) : nullptr;
    }
    // dim(operand, 1) is the innermost dimension, dim(operand, 2) the one before, ...
    __device__ __forceinline__ int dim(int operand, int from_end) const {
        return buf(operand).shape[MAX_RANK - from_end];
    }
    __device__ __forceinline__ int dtype(int operand) const { return buf(operand).dtype; }
    // A DT_F32_TAGGED buffer's tagged copy: after its numel floats (rounded up to 8 bytes), one
    // 8-byte word per element (tag_value: the value and the step that wrote it; the runtime zeroes
    // them, and steps count from 1). Null for any other dtype.
    // A DT_FP8_TILES weight's float32 scales: after its numel bytes, rounded up to 16 (mkc/ir/fp8.py).
    __device__ __forceinline__ const float* scales(int operand) const {
        const BufDesc& b = buf(operand);
        size_t n = 1;
#pragma unroll
        for (int i = 0; i < MAX_RANK; ++i) n *= (size_t)b.shape[i];
        return reinterpret_cast<const float*>(reinterpret_cast<const unsigned char*>(b.ptr) + (n + 15) / 16 * 16);
    }
    __device__ __forceinline__ u64* tagged(int operand) const {
        const BufDesc& b = buf(operand);
        if (b.dtype != DT_F32_TAGGED) return nullptr;
        size_t n = 1;
#pragma unroll
        for (int i = 0; i < MAX_RANK; ++i) n *= (size_t)b.shape[i];
        return reinterpret_cast<u64*>(b.ptr) + (n + 1) / 2;
    }
};
