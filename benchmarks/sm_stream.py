"""How fast can A SMs read HBM, and does it matter which SMs? (GPU, one call)

Every GEMV tile of the megakernel streams its weights on one SM, and at batch 1-8 a layer's phases
run on fewer than all SMs (at batch 1 the expert gate/up tiles on ~96 of 132, beside the attention
splits). So a phase's read rate is bounded by what its SMs can pull, not only by the HBM. This
measures that away from the megakernel: one CTA per SM (256 threads and 200 KiB of shared memory,
the kernel's shape); the CTAs on the SMs picked each read their own contiguous region of
`--mib-per-sm` MiB, the rest exit at once; CUDA events, the median of `--reps` launches after one
checked launch; the regions together are several times the L2, so every byte comes from HBM.

Which SMs: first the GPCs are found (a cluster's CTAs run in one GPC: CTAs launched in clusters of
4 and of 16, SMs that ran one cluster joined), then A SMs are picked "packed" (filling one GPC after
another), "spread" (one SM of each GPC in turn) or "low" (the lowest SM ids). It also prints where
a plain launch puts CTA i (the megakernel's queue i).

Ways to read, each the shape of a path the megakernel has or could have:

* ``ldg D``: 16-byte ``ld.global.nc.L1::no_allocate`` loads in two register batches of D per thread
  (the GEMV's software pipeline: batch i + 1 is issued before batch i is used), so 256 x 16 x D to
  2 x that many bytes are in flight per SM.
* ``bulk C S``: one thread keeps S bulk copies (``cp.async.bulk``, TMA) of C bytes each in flight
  into a shared-memory ring, completing on one mbarrier per stage; every thread reads its share of
  a landed stage and the CTA syncs before the stage is refilled (C x S bytes in flight per SM; the
  sync per stage costs small stages their rate).

    python benchmarks/sm_stream.py [--active 8,16,32,64,96,132] [--ways "ldg 8,bulk 32768 4"]
        [--patterns packed,spread] [--mib-per-sm 8] [--reps 5] [--json OUT.json]
    python benchmarks/sm_stream.py --l2 [--keep-kib-per-sm 160] [--stream-kib-per-sm 576]

With ``--l2``, instead of the table: the L2's read rate (each SM re-reading 64 KiB of its own), and
what share of a region read with an eviction priority (21 MB by default: a layer's QKV and router
weights) is still in L2 after other bytes stream with one (78 MB: a batch-1 layer's expert weights):
whether a layer's weights read once could be read again from L2 later in the step (docs/kernel.md,
"The layer boundary off the chain").

Prints the GPCs, then a table of GB/s per SM and TB/s in all, per way, pattern and SM count. The
sum of every byte read is checked against torch's (a wrong address or a stage read before it
landed shows up).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
from pathlib import Path

THREADS = 256
SMEM = 200 * 1024  # dynamic shared memory of every launch

SOURCE = r"""
typedef unsigned int u32;
typedef unsigned long long u64;

__device__ __forceinline__ uint4 ldg16(const void* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

// The same with an L2 eviction priority (createpolicy): 1 evict-first, 2 evict-last.
template <int POL>
__device__ __forceinline__ uint4 ldg16(const void* p, u64 pol) {
    if constexpr (POL == 0) {
        return ldg16(p);
    } else {
        uint4 v;
        asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
                     : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p), "l"(pol));
        return v;
    }
}

template <int POL>
__device__ __forceinline__ u64 l2_policy() {
    u64 pol = 0;
    if constexpr (POL == 1) asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
    if constexpr (POL == 2) asm("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(pol));
    return pol;
}

__device__ __forceinline__ u32 fold(uint4 v) { return v.x + v.y + v.z + v.w; }

// The wrapping sum of every 32-bit word each active CTA read, into sums[blockIdx.x].
// WARPS: each warp streams its own contiguous part of the region (as the GEMV's warps each stream a
// 16-row group), else the CTA sweeps the region as one stream.
template <int D, bool WARPS = false, int POL = 0>
__device__ void read_ldg(const uint4* base, size_t vecs, u32* sums) {
    const u64 pol = l2_policy<POL>();
    u32 s = 0;
    uint4 a[D], b[D];
    const int lanes = WARPS ? 32 : blockDim.x, lane = WARPS ? threadIdx.x % 32 : threadIdx.x;
    if (WARPS) {
        vecs /= blockDim.x / 32;
        base += (threadIdx.x / 32) * vecs;
    }
    const size_t step = (size_t)D * lanes;  // vectors per batch
#pragma unroll
    for (int j = 0; j < D; ++j) a[j] = ldg16<POL>(base + j * lanes + lane, pol);
    for (size_t i = step; i < vecs; i += 2 * step) {
#pragma unroll
        for (int j = 0; j < D; ++j) b[j] = ldg16<POL>(base + i + j * lanes + lane, pol);
#pragma unroll
        for (int j = 0; j < D; ++j) s += fold(a[j]);
        if (i + step < vecs) {
#pragma unroll
            for (int j = 0; j < D; ++j) a[j] = ldg16<POL>(base + i + step + j * lanes + lane, pol);
        } else {
#pragma unroll
            for (int j = 0; j < D; ++j) a[j] = make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int j = 0; j < D; ++j) s += fold(b[j]);
    }
#pragma unroll
    for (int j = 0; j < D; ++j) s += fold(a[j]);
    atomicAdd(sums + blockIdx.x, s);
}

__device__ __forceinline__ u32 smid() {
    u32 id;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(id));
    return id;
}

// Whether this CTA streams: the SM it landed on is picked (pick[smid] != 0). Its region is its
// blockIdx's, so the regions stay disjoint whichever SMs are picked.
__device__ __forceinline__ bool picked(const unsigned char* pick) { return pick[smid()] != 0; }

#define LDG_KERNEL(D) \
extern "C" __global__ void __launch_bounds__(256, 1) stream_ldg_##D(const uint4* data, size_t vecs, size_t stride, \
                                                                   const unsigned char* pick, u32* sums) { \
    if (!picked(pick)) return; \
    read_ldg<D>(data + (size_t)blockIdx.x * stride, vecs, sums); \
}
// The same at 512 threads (the warps of two 256-thread CTAs on one SM)
#define LDG512_KERNEL(D) \
extern "C" __global__ void __launch_bounds__(512, 1) stream_ldg512_##D(const uint4* data, size_t vecs, \
                                                                      size_t stride, const unsigned char* pick, \
                                                                      u32* sums) { \
    if (!picked(pick)) return; \
    read_ldg<D>(data + (size_t)blockIdx.x * stride, vecs, sums); \
}
LDG512_KERNEL(4)
LDG512_KERNEL(8)
// Each warp its own stream
#define LDGW_KERNEL(D) \
extern "C" __global__ void __launch_bounds__(256, 1) stream_ldgw_##D(const uint4* data, size_t vecs, size_t stride, \
                                                                    const unsigned char* pick, u32* sums) { \
    if (!picked(pick)) return; \
    read_ldg<D, true>(data + (size_t)blockIdx.x * stride, vecs, sums); \
}
LDGW_KERNEL(8)
LDGW_KERNEL(16)
LDG_KERNEL(2)
LDG_KERNEL(4)
LDG_KERNEL(8)
LDG_KERNEL(16)

__device__ __forceinline__ u32 smem_addr(const void* p) { return (u32)__cvta_generic_to_shared(p); }

extern "C" __global__ void __launch_bounds__(256, 1) stream_bulk(const unsigned char* data, size_t bytes,
                                                                  size_t stride, const unsigned char* pick,
                                                                  u32* sums, u32 chunk,
                                                                  u32 stages) {
    extern __shared__ __align__(128) unsigned char ring[];
    __shared__ __align__(8) u64 bar[32];
    if (!picked(pick)) return;
    const unsigned char* base = data + (size_t)blockIdx.x * stride;
    const u32 chunks = (u32)(bytes / chunk);
    if (threadIdx.x < stages)
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(bar + threadIdx.x)) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    __syncthreads();
    auto issue = [&](u32 c) {  // chunk c into stage c % stages
        const u32 st = c % stages;
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar + st)), "r"(chunk)
                     : "memory");
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                     ::"r"(smem_addr(ring + (size_t)st * chunk)), "l"(base + (size_t)c * chunk), "r"(chunk),
                     "r"(smem_addr(bar + st)) : "memory");
    };
    if (threadIdx.x == 0)
        for (u32 c = 0; c < stages && c < chunks; ++c) issue(c);
    u32 s = 0;
    for (u32 c = 0; c < chunks; ++c) {
        const u32 st = c % stages, parity = (c / stages) & 1u;
        for (;;) {
            u32 done;
            asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                         " selp.u32 %0, 1, 0, p;\n}" : "=r"(done) : "r"(smem_addr(bar + st)), "r"(parity) : "memory");
            if (done) break;
        }
        const uint4* v = reinterpret_cast<const uint4*>(ring + (size_t)st * chunk);
        for (u32 i = threadIdx.x; i < chunk / 16; i += blockDim.x) s += fold(v[i]);
        __syncthreads();  // every thread has read stage st
        if (threadIdx.x == 0 && c + stages < chunks) issue(c + stages);
    }
    atomicAdd(sums + blockIdx.x, s);
}

// Every CTA reads its region `passes` times with L2 eviction priority `policy` (0 none, 1 first,
// 2 last): the L2's read rate (a region that fits, read again) and what stays in it (--l2).
extern "C" __global__ void __launch_bounds__(256, 1) l2_read(const uint4* data, size_t vecs, size_t stride,
                                                              int passes, int policy, u32* sums) {
    const uint4* base = data + (size_t)blockIdx.x * stride;
    for (int p = 0; p < passes; ++p) {
        if (policy == 1) read_ldg<8, false, 1>(base, vecs, sums);
        else if (policy == 2) read_ldg<8, false, 2>(base, vecs, sums);
        else read_ldg<8, false, 0>(base, vecs, sums);
    }
}

// Where each CTA ran: smid[blockIdx] (a plain launch: the megakernel's queue -> SM map)
extern "C" __global__ void where_ctas_run(u32* sm_of) {
    if (threadIdx.x == 0) sm_of[blockIdx.x] = smid();
}

// The same in clusters of four, and of sixteen (a non-portable size): a cluster's CTAs run on SMs of
// one GPC, so SMs that share a cluster share a GPC (the host joins them over the launches).
extern "C" __global__ void __cluster_dims__(4, 1, 1) where_clusters_run(u32* sm_of) {
    if (threadIdx.x == 0) sm_of[blockIdx.x] = smid();
}
extern "C" __global__ void __cluster_dims__(16, 1, 1) where_clusters16_run(u32* sm_of) {
    if (threadIdx.x == 0) sm_of[blockIdx.x] = smid();
}
"""

LDG_DEPTHS = (2, 4, 8, 16)
LDG512_DEPTHS = (4, 8)  # ldg512: 512 threads
LDGW_DEPTHS = (8, 16)  # ldgw: a stream per warp


def _check(result, what):
    err, *rest = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise RuntimeError(f"{what} failed: {err}")
    return rest[0] if len(rest) == 1 else rest


def parse_way(text: str) -> tuple:
    parts = text.split()
    if parts[0] == "ldg" and len(parts) == 2 and int(parts[1]) in LDG_DEPTHS:
        return ("ldg", int(parts[1]))
    if parts[0] == "ldg512" and len(parts) == 2 and int(parts[1]) in LDG512_DEPTHS:
        return ("ldg512", int(parts[1]))
    if parts[0] == "ldgw" and len(parts) == 2 and int(parts[1]) in LDGW_DEPTHS:
        return ("ldgw", int(parts[1]))
    if parts[0] == "bulk" and len(parts) == 3:
        chunk, stages = int(parts[1]), int(parts[2])
        if chunk % 16 or not 1 <= stages <= 32 or chunk * stages > 200 * 1024:
            raise ValueError(f"bulk {chunk} {stages}: chunk a multiple of 16 bytes, 1-32 stages, "
                             f"at most 200 KiB of ring")
        return ("bulk", chunk, stages)
    raise ValueError(f"way {text!r}: expected 'ldg D' (D in {LDG_DEPTHS}), 'ldg512 D' (512 threads, D in "
                     f"{LDG512_DEPTHS}), 'ldgw D' (a stream per warp, D in {LDGW_DEPTHS}) or 'bulk CHUNK_BYTES STAGES'")


def in_flight(way: tuple) -> int:
    if way[0] == "bulk":
        return way[1] * way[2]
    return threads_of(way) * 16 * way[1] * 2


def threads_of(way: tuple) -> int:
    return 512 if way[0] == "ldg512" else THREADS


def compile_kernels() -> tuple[bytes, str]:
    """(cubin, ptxas log) of SOURCE for sm_90a, by NVRTC (no GPU needed)."""
    from mkc.codegen import nvrtc

    return nvrtc.compile_cubin(SOURCE, "sm_stream", nvrtc.options(Path(__file__).parent), None)


def gpcs_from_clusters(clusters: list[list[int]]) -> list[list[int]]:
    """SMs grouped by GPC: the SMs that ran one cluster's CTAs share a GPC, and sharing is
    transitive; the groups sorted by their smallest SM."""
    parent: dict[int, int] = {}

    def root(x: int) -> int:
        parent.setdefault(x, x)
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for cluster in clusters:
        first = root(cluster[0])
        for sm in cluster[1:]:
            parent[root(sm)] = first
    groups: dict[int, list[int]] = {}
    for sm in parent:
        groups.setdefault(root(sm), []).append(sm)
    return sorted((sorted(g) for g in groups.values()), key=lambda g: g[0])


def pick_sms(gpcs: list[list[int]], count: int, pattern: str) -> list[int]:
    """``count`` SMs (fewer where the GPCs hold fewer): "packed" fills one GPC after another, "spread"
    takes one SM of each GPC in turn, "low" the lowest SM ids."""
    if pattern == "packed":
        return [sm for g in gpcs for sm in g][:count]
    if pattern == "spread":
        out = []
        for depth in range(max(map(len, gpcs))):
            out += [g[depth] for g in gpcs if depth < len(g)]
        return out[:count]
    if pattern == "low":
        return sorted(sm for g in gpcs for sm in g)[:count]
    raise ValueError(f"pattern {pattern!r}: expected 'packed', 'spread' or 'low'")


def median_us(torch, reps: int, call, setup=lambda: None) -> float:
    """The median over ``reps`` of ``call``'s time on the GPU in µs (CUDA events), ``setup`` enqueued
    before each."""
    times = []
    for _ in range(reps):
        setup()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        call()
        e1.record()
        torch.cuda.synchronize()
        times.append(e0.elapsed_time(e1) * 1e3)
    return sorted(times)[len(times) // 2]


L2_POLICIES = {0: "no hint", 1: "evict-first", 2: "evict-last"}


def l2_report(torch, launch, sms: int, a) -> dict:
    """--l2: every SM reads a region of its own with ``l2_read`` (8-deep register batches).

    1. The L2's read rate: regions of 64 KiB per SM (8.4 MB on 132 SMs), read once, then 16 times
       in one launch, timed.
    2. What stays in L2: a region to keep (``--keep-kib-per-sm``) is read with an eviction priority,
       then ``--stream-kib-per-sm`` of other bytes with one, then the kept region is read again and
       timed, against the same read cold (after 1 GiB of other reads) and warm (read just before).
       The share kept is (cold - after) / (cold - warm).
    """
    kib = 1024
    sums = torch.zeros(sms, dtype=torch.int32, device="cuda")
    bufs: dict[int, object] = {}

    def buf(kib_per_sm: int):
        if kib_per_sm not in bufs:
            bufs[kib_per_sm] = torch.randint(-2**31, 2**31 - 1, (sms * kib_per_sm * kib // 4,), dtype=torch.int32,
                                             device="cuda")
        return bufs[kib_per_sm]

    def read(kib_per_sm: int, passes: int = 1, policy: int = 0):
        vecs = kib_per_sm * kib // 16
        launch([ctypes.c_void_p(buf(kib_per_sm).data_ptr()), ctypes.c_size_t(vecs), ctypes.c_size_t(vecs),
                ctypes.c_int(passes), ctypes.c_int(policy), ctypes.c_void_p(sums.data_ptr())])

    flush = 8 * kib  # KiB per SM: 1 GiB on 132 SMs
    keep, stream = a.keep_kib_per_sm, a.stream_kib_per_sm
    sums.zero_()
    read(keep)
    torch.cuda.synchronize()
    want = (buf(keep).view(sms, -1).to(torch.int64).sum(dim=1) % 2**32).cpu()
    if not torch.equal(sums.cpu().to(torch.int64) % 2**32, want):
        raise SystemExit("--l2: the sums of what was read differ from torch's: a read went wrong")

    read(64)
    t = median_us(torch, a.reps, lambda: read(64, passes=16))
    rate = 64 * kib * 16 / (t * 1e-6)
    print(f"L2 read rate: {sms} SMs each reading its 64 KiB 16 times: {t:.1f} µs, {rate / 1e9:.1f} GB/s per SM, "
          f"{rate * sms / 1e12:.2f} TB/s in all")

    def after(keep_policy: int, stream_policy: int | None):  # the set-up before the kept region's read
        def setup():
            read(flush)
            read(keep, policy=keep_policy)
            if stream_policy is not None:
                read(stream, policy=stream_policy)
        return setup

    cold = median_us(torch, a.reps, lambda: read(keep), lambda: read(flush))
    warm = median_us(torch, a.reps, lambda: read(keep), after(0, None))
    mb = sms * keep * kib / 1e6
    print(f"kept region: {mb:.1f} MB ({keep} KiB per SM): cold {cold:.1f} µs, read again at once {warm:.1f} µs")
    rows = []
    for kp, sp in ((0, 0), (2, 0), (2, 1), (0, 1)):
        t = median_us(torch, a.reps, lambda: read(keep), after(kp, sp))
        share = (cold - t) / (cold - warm) if cold > warm else float("nan")
        rows.append({"keep_policy": L2_POLICIES[kp], "stream_policy": L2_POLICIES[sp], "us": t, "kept_share": share})
        print(f"  read {L2_POLICIES[kp]}, then {sms * stream * kib / 1e6:.1f} MB streamed {L2_POLICIES[sp]}: "
              f"{t:.1f} µs, {share:.0%} kept")
    return {"l2_read_gb_per_s_per_sm": rate / 1e9, "keep_mb": mb, "stream_mb": sms * stream * kib / 1e6,
            "cold_us": cold, "warm_us": warm, "after_streams": rows}


def parse_args(argv) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--active", default="1,8,16,32,64,96,132")
    ap.add_argument("--ways", default="ldg 8,ldg 16")
    ap.add_argument("--patterns", default="low")
    ap.add_argument("--skews", default="0",
                    help="bytes between one SM's region and the next beyond their size (0: regions back to "
                         "back, each at a multiple of the size)")
    ap.add_argument("--mib-per-sm", type=int, default=8)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--l2", action="store_true",
                    help="instead of the table: the L2's read rate and what stays in it under other streams")
    ap.add_argument("--keep-kib-per-sm", type=int, default=160,
                    help="--l2: the region to keep (160 KiB per SM: 21 MB, a layer's QKV and router weights)")
    ap.add_argument("--stream-kib-per-sm", type=int, default=576,
                    help="--l2: the bytes streamed in between (576 KiB per SM: 78 MB, a batch-1 layer's "
                         "experts)")
    ap.add_argument("--json", type=Path)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    ways = [parse_way(w.strip()) for w in a.ways.split(",")]
    actives = [int(x) for x in a.active.split(",")]
    patterns = a.patterns.split(",")

    import torch
    from cuda.bindings import driver

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    actives = [min(n, sms) for n in actives]
    k = Kernels(torch, driver, sms)
    gpu = torch.cuda.get_device_name(0)
    if a.l2:  # every SM reads: no GPCs needed
        report = l2_report(torch, lambda args: k.launch(k.l2_read, args), sms, a)
        if a.json:
            a.json.write_text(json.dumps({"gpu": gpu, "sms": sms, **report}, indent=1))
        return 0
    cta_sm, gpcs = find_gpcs(torch, k, gpu)
    rows = stream_table(torch, k, gpcs, a, ways, actives, patterns)
    if a.json:
        a.json.write_text(json.dumps({"gpu": gpu, "sms": sms, "mib_per_sm": a.mib_per_sm, "cta_sm": cta_sm,
                                      "gpcs": gpcs, "rows": rows}, indent=1))
    return 0


class Kernels:
    """SOURCE's kernels loaded on GPU 0 through the driver API, each with 200 KiB of dynamic shared
    memory, so that one CTA fits an SM, as the megakernel's."""

    def __init__(self, torch, driver, sms: int):
        self.driver, self.sms = driver, sms
        torch.zeros(1, device="cuda")
        _check(driver.cuInit(0), "cuInit")
        ctx = _check(driver.cuDevicePrimaryCtxRetain(_check(driver.cuDeviceGet(0), "cuDeviceGet")), "retain")
        _check(driver.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
        cubin, _ = compile_kernels()
        self.module = _check(driver.cuModuleLoadData(cubin), "cuModuleLoadData")
        self.streams = {("ldg", d): self.func(f"stream_ldg_{d}") for d in LDG_DEPTHS}  # by way
        self.streams |= {("ldg512", d): self.func(f"stream_ldg512_{d}") for d in LDG512_DEPTHS}
        self.streams |= {("ldgw", d): self.func(f"stream_ldgw_{d}") for d in LDGW_DEPTHS}
        self.l2_read = self.func("l2_read")
        self.bulk, self.where = self.func("stream_bulk"), self.func("where_ctas_run")
        self.where_clusters = self.func("where_clusters_run")
        self.where_clusters16 = self.func("where_clusters16_run")
        self.stream = driver.CUstream(torch.cuda.current_stream().cuda_stream)

    def func(self, name: str):
        driver = self.driver
        f = _check(driver.cuModuleGetFunction(self.module, name.encode()), "cuModuleGetFunction")
        # 200 KiB of shared memory each: one CTA per SM, as the megakernel
        attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        _check(driver.cuFuncSetAttribute(f, attr, SMEM), "smem attribute")
        return f

    def launch(self, f, args, grid: int | None = None, threads: int = THREADS) -> None:
        """f on ``grid`` CTAs (default: one per SM) with ``args`` (ctypes values)."""
        ptrs = (ctypes.c_void_p * len(args))(*(ctypes.addressof(x) for x in args))
        _check(self.driver.cuLaunchKernel(f, self.sms if grid is None else grid, 1, 1, threads, 1, 1, SMEM,
                                          self.stream, ctypes.addressof(ptrs), 0), "cuLaunchKernel")


def find_gpcs(torch, k: Kernels, gpu: str) -> tuple[list[int], list[list[int]]]:
    """(the SM a plain launch puts each CTA on, the SMs grouped by GPC), both printed. A cluster's
    CTAs run in one GPC, so the SMs that ran one cluster (of 4 or of 16, 4 launches each) share a
    GPC; an SM no cluster ran on is a group of its own."""
    driver, sms = k.driver, k.sms
    sm_of = torch.zeros(sms, dtype=torch.int32, device="cuda")
    maps = []
    for _ in range(3):
        k.launch(k.where, [ctypes.c_void_p(sm_of.data_ptr())])
        maps.append(sm_of.tolist())
    clusters: dict[int, list[list[int]]] = {4: [], 16: []}  # by size: the SMs each cluster ran on
    for f, size in ((k.where_clusters, 4), (k.where_clusters16, 16)):
        grid = sms // size * size
        try:
            if size > 8:
                attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED
                _check(driver.cuFuncSetAttribute(f, attr, 1), "attr")
            for _ in range(4):
                k.launch(f, [ctypes.c_void_p(sm_of.data_ptr())], grid)
                torch.cuda.synchronize()
                ran = sm_of.tolist()
                clusters[size] += [ran[c:c + size] for c in range(0, grid, size)]
        except RuntimeError as e:
            print(f"the launch in clusters of {size} failed: {e}")
    for size, cs in clusters.items():
        if cs:
            print(f"clusters of {size}: {[len(g) for g in gpcs_from_clusters(cs)]} SMs a group")
    gpcs = gpcs_from_clusters(clusters[4] + clusters[16])  # both sizes joined
    seen = {sm for g in gpcs for sm in g}
    gpcs += [[sm] for sm in sorted(set(maps[0]) - seen)]
    print(f"{gpu}: {sms} SMs; a plain launch puts CTA i on SM {maps[0][:16]} ... "
          f"({'the same' if maps[0] == maps[1] == maps[2] else 'not the same'} in 3 launches)")
    print(f"GPCs (SMs that ran one cluster, joined over the launches; {sum(map(len, gpcs))} SMs): "
          f"{len(gpcs)} of sizes {[len(g) for g in gpcs]}")
    for g in gpcs:
        print("  ", g)
    return maps[0], gpcs


def stream_table(torch, k: Kernels, gpcs: list[list[int]], a: argparse.Namespace, ways: list[tuple],
                 actives: list[int], patterns: list[str]) -> list[dict]:
    """The table: per skew, way and pattern, the read rate of each count of SMs, printed a line at
    a time; returns its cells as rows for --json."""
    sms, per_sm = k.sms, a.mib_per_sm << 20
    sums = torch.zeros(sms, dtype=torch.int32, device="cuda")
    pick = torch.zeros(256, dtype=torch.uint8, device="cuda")
    rows = []
    print(f"{a.mib_per_sm} MiB per SM, {THREADS} threads, median of {a.reps}; each cell: GB/s per SM, "
          "TB/s in all")
    print(f"{'way':<16} {'SMs picked':<10} {'skew':>8} {'in flight':>10} "
          + " ".join(f"{n:>13}" for n in actives))
    for skew in (int(x) for x in a.skews.split(",")):
        if skew % 16:
            raise SystemExit(f"--skews: {skew} is not a multiple of 16 bytes")
        stride = per_sm + skew
        data = torch.randint(-2**31, 2**31 - 1, (sms * stride // 4,), dtype=torch.int32, device="cuda")
        words = data.view(sms, stride // 4)[:, :per_sm // 4].to(torch.int64)
        expect = (words.sum(dim=1) % 2**32).cpu()  # the wrapping u32 sum of each CTA's region
        del words

        def run(way, data=data, stride=stride):
            sums.zero_()
            region = ctypes.c_void_p(data.data_ptr())
            out = [ctypes.c_void_p(pick.data_ptr()), ctypes.c_void_p(sums.data_ptr())]
            if way[0] != "bulk":
                vecs = [ctypes.c_size_t(per_sm // 16), ctypes.c_size_t(stride // 16)]  # 16-byte loads
                k.launch(k.streams[way], [region, *vecs, *out], threads=threads_of(way))
            else:
                k.launch(k.bulk, [region, ctypes.c_size_t(per_sm), ctypes.c_size_t(stride), *out,
                                  ctypes.c_uint32(way[1]), ctypes.c_uint32(way[2])])

        for way in ways:
            for pattern in patterns:
                cells = []
                for active in actives:
                    chosen = pick_sms(gpcs, active, pattern)
                    pick.zero_()
                    pick[torch.tensor(chosen, dtype=torch.long)] = 1
                    run(way)
                    torch.cuda.synchronize()
                    got = sums.cpu().to(torch.int64) % 2**32
                    ran = got != 0
                    if int(ran.sum()) != len(chosen) or not torch.equal(got[ran], expect[ran]):
                        raise SystemExit(f"{way} {pattern} {active}: {int(ran.sum())} CTAs read, "
                                         f"{len(chosen)} picked, or their sums differ from torch's: a read "
                                         "went wrong")
                    t = median_us(torch, a.reps, lambda way=way: run(way)) * 1e-6  # seconds
                    total = len(chosen) * per_sm / t
                    cells.append(f"{total / len(chosen) / 1e9:6.1f} {total / 1e12:5.2f}")
                    rows.append({"way": " ".join(map(str, way)), "pattern": pattern, "skew": skew,
                                 "in_flight_bytes": in_flight(way), "active_sms": len(chosen), "seconds": t,
                                 "gb_per_s_per_sm": total / len(chosen) / 1e9, "tb_per_s": total / 1e12})
                name = " ".join(map(str, way))
                print(f"{name:<16} {pattern:<10} {skew:>8} {in_flight(way) // 1024:>8} K "
                      + " ".join(f"{c:>13}" for c in cells), flush=True)
    return rows


if __name__ == "__main__":
    sys.exit(main())
