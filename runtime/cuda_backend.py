"""The GPU backend: load the megakernel's cubin and run decode steps with it.

``CudaDecoder(schedule, spec, weights)`` owns, on torch's current CUDA device:

* the module (``cuModuleLoadData`` of the NVRTC cubin, in torch's primary context);
* every buffer of the schedule as a torch tensor (``buffers[name]``): weights in bf16, laid out
  once at load: the lowering's logical layout, except the GEMV weights named in ``tiled`` when the
  kernel reads tile order (CodegenOptions.weight_layout, mkc/codegen/weight_tiles.py), which are
  reordered copies, or the caller's own tensors when they come as ``TiledWeights`` already in that
  order (weight_tiles.tile_ordered_in_place); activations (poisoned with NaN / -1 at allocation,
  so a read of something never written shows), the KV cache ``[B, kv_heads, ctx, head_dim]`` per
  layer, the inputs and the outputs;
* the task words (``mkc.codegen.taskwords``) and the buffer table in device memory;
* the counters (uint32, zero at allocation, never reset: step ``s`` waits for ``target * s``) and
  the abort word of the device watchdog.

``step(tokens, positions)`` launches one persistent kernel (one CTA per SM, co-residency checked
with the occupancy API at load) on torch's current stream, waits for it, and returns (logits,
next_token). A task that waits longer than the watchdog (``MKC_WATCHDOG_MS``) on a counter makes
every CTA exit; ``step`` then raises ``StepTimeout`` naming the task and the counter, and the
decoder must be ``reset()`` (its counters are no longer in step) before it is used again.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from mkc import settings
from mkc.codegen import KernelArtifact, build_kernel
from mkc.codegen.render import CodegenOptions
from mkc.codegen.taskwords import buffer_table, encode, record_descriptors, routing_logits, tagged_words
from mkc.codegen.weight_tiles import (
    TILE_ROWS,
    TiledWeights,
    fp8_stored,
    from_tiles,
    from_tiles_fp8,
    logical_weight,
    padded_weights,
    stored_shape,
    stored_weight,
    tiled_weights,
)
from mkc.ir import fp8
from mkc.ir.kv_layout import identity_page_table, logical_view, page_size_of
from mkc.ir.spec import ModelSpec
from mkc.schedule.schedule import Schedule

TORCH_DTYPES = {"bf16": torch.bfloat16, "f32": torch.float32, "i32": torch.int32, "fp8": torch.float8_e4m3fn}
ABORT_WORDS = 8  # flag, task id, counter, counter value, value needed, SM, -, -
# a profiled step's %globaltimer words per record, in the kernel's order (kernel.cu.j2: PROF_WORDS):
# the first 3, or every one with CodegenOptions.profile_phases
PROFILE_WORDS = ("wait", "start", "end", "staged", "done", "routed", "opened", "routing", "logits", "ranked")
# A LINEAR tile that waits inside its op derives no routing and writes its staging's marks into the
# routing's slots (ops.cuh WaitStageFinish); the timeline gives them columns of their own: every warp
# through the wait's barrier (synced), thread 0's copies issued, landed (profile.LINEAR_STAGING_PHASES)
STAGING_MARK_OPS = ("LINEAR",)
STAGING_MARKS = {"opened": "synced", "routing": "issued", "logits": "landed"}


def timeline_from_profile(raw, queues, staging=None) -> dict[str, np.ndarray]:
    """A profiled step's timeline (CudaDecoder.timeline) from the kernel's profile buffer: ``raw``
    holds one row of %globaltimer words (ns) per record in queue order (PROFILE_WORDS; 0 where a
    mark was not taken), ``queues`` the schedule's task ids per SM. Times are µs from the earliest
    wait, rows in task-id order; a task starts when its wait ends. With every word of the
    phase-marking kernel, ``staging`` (bool per task id: the tasks of STAGING_MARK_OPS) says which
    tasks' routing slots hold staging marks: those move to the STAGING_MARKS columns (NaN for every
    other task), leaving the routing's columns NaN for them."""
    raw = np.asarray(raw, dtype=np.float64).copy()
    words = raw.shape[1] if raw.ndim == 2 else 0
    if words == len(PROFILE_WORDS):
        for j in (3, 5, 6, 7, 8, 9):  # not a staging op; routes nothing; no such routing phase
            raw[raw[:, j] == 0, j] = np.nan
    order = np.concatenate([np.asarray(q, dtype=np.int64) for q in queues] or [np.zeros(0, dtype=np.int64)])
    sm = np.concatenate([np.full(len(q), i) for i, q in enumerate(queues)] or [np.zeros(0, dtype=np.int64)])
    t0 = raw[:, 0].min() if len(raw) else 0.0
    out = {"sm": np.empty(len(order), dtype=np.int64)}
    for j, name in enumerate(PROFILE_WORDS[:words]):
        out[name] = np.empty(len(order))
        out[name][order] = (raw[:, j] - t0) / 1e3
    out["sm"][order] = sm
    if words == len(PROFILE_WORDS):
        marks = np.zeros(len(order), dtype=bool) if staging is None else np.asarray(staging, dtype=bool)
        if marks.shape != (len(order),):
            raise ValueError(f"timeline_from_profile: staging has {marks.shape} entries, expected one per task "
                             f"({len(order)})")
        for slot, name in STAGING_MARKS.items():
            out[name] = np.where(marks, out[slot], np.nan)
            out[slot] = np.where(marks, np.nan, out[slot])
    return out


class CudaError(RuntimeError):
    """A CUDA driver call failed (the message names the call and the error)."""


class StepTimeout(RuntimeError):
    """The device watchdog fired: a task waited too long on a counter (names both)."""


def _check(result, what: str):
    from cuda.bindings import driver

    err, *rest = result if isinstance(result, tuple) else (result,)
    if err != driver.CUresult.CUDA_SUCCESS:
        _, name = driver.cuGetErrorName(err)
        raise CudaError(f"{what} failed: {name.decode() if isinstance(name, bytes) else name}")
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else tuple(rest)


def cuda_available() -> bool:
    """True when a CUDA driver and device are usable (cuInit raises without a driver)."""
    try:
        from cuda.bindings import driver

        (err,) = driver.cuInit(0)
        return err == driver.CUresult.CUDA_SUCCESS and torch.cuda.is_available()
    except (ImportError, OSError, RuntimeError):  # no bindings, no driver library
        return False


@dataclass(frozen=True, slots=True)
class LaunchConfig:
    grid: int  # CTAs = the schedule's SM count (one per SM)
    threads: int  # per CTA
    dynamic_smem: int  # bytes
    # as the driver reports the loaded kernel (the artifact's own come from the compile log)
    regs: int = -1  # registers per thread
    static_smem: int = -1  # bytes per CTA


class LogicalWeights(Mapping):
    """Weights by their lowering names in the lowering's row-major layout, over buffers some of
    which are stored in tile order (``tiled``): PyTorch code such as the prefill reads them. A
    tile-ordered weight is reordered back on each access, one matrix at a time: ``w[name][e]`` of
    an expert stack reorders expert e only. Nothing is kept, so the weights are held once. A weight
    stored with zero rows or columns (``padded``: name to its logical (rows, K)) is seen without them."""

    def __init__(self, buffers: dict[str, torch.Tensor], names: list[str], tiled: frozenset[str],
                 padded: dict[str, tuple[int, int]] | None = None, scales: dict[str, torch.Tensor] | None = None):
        self._buffers, self._names, self._tiled = buffers, dict.fromkeys(names), tiled
        self._padded = padded or {}
        self._scales = scales or {}  # FP8 weights' scales: those weights come back dequantised to bf16

    def __getitem__(self, name: str):
        if name not in self._names:
            raise KeyError(name)
        t = self._buffers[name]
        if name in self._scales:
            return _TiledStack(t, scales=self._scales[name]) if t.dim() == 3 else self.matrix(name)
        if name in self._tiled and t.dim() == 3:
            return _TiledStack(t, self._padded.get(name))
        return logical_weight(t, name in self._tiled, self._padded.get(name))

    def matrix(self, name: str) -> torch.Tensor:
        """The whole weight row-major, an expert stack [E, R, K] included (one reordered copy)."""
        if name not in self._names:
            raise KeyError(name)
        if name in self._scales:
            return _fp8_rows(self._buffers[name], self._scales[name])
        return logical_weight(self._buffers[name], name in self._tiled, self._padded.get(name))

    def rows(self, name: str, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` [T] of a matrix [R, K] (an embedding), reordering only their 16-row groups."""
        t = self._buffers[name]
        k = self._padded[name][1] if name in self._padded else t.shape[-1]
        if name not in self._tiled:
            return t[ids][..., :k]
        r, kp = t.shape
        groups = from_tiles(t.view(r // TILE_ROWS, TILE_ROWS, kp)[ids // TILE_ROWS])  # [T, 16, K]
        return groups[torch.arange(ids.numel(), device=ids.device), ids % TILE_ROWS][..., :k]

    def __contains__(self, name) -> bool:  # without reordering (or dequantising) the weight
        return name in self._names

    def __iter__(self):
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def _fp8_rows(t: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """An FP8 weight in tile order, row-major and dequantised to bf16."""
    q = from_tiles_fp8(t.view(torch.uint8)).view(torch.float8_e4m3fn)
    return fp8.dequantize(q, scales).to(torch.bfloat16)



class _TiledStack:
    """A tile-ordered stack of matrices [E, R, K]; indexing by e gives matrix e row-major (without
    its zero rows and columns where padded from ``logical`` = (R, K); an FP8 stack's dequantised
    to bf16)."""

    def __init__(self, t: torch.Tensor, logical: tuple[int, int] | None = None, scales: torch.Tensor | None = None):
        self._t, self._logical, self._scales = t, logical, scales
        self.shape = t.shape if logical is None else (*t.shape[:-2], *logical)

    def __getitem__(self, e) -> torch.Tensor:
        if self._scales is not None:
            return _fp8_rows(self._t[e], self._scales[e])
        return logical_weight(self._t[e], True, self._logical)


class CudaDecoder:
    """One schedule (batch, context bucket) on one GPU. Not thread-safe."""

    def __init__(self, schedule: Schedule, spec: ModelSpec, weights: dict[str, torch.Tensor], *,
                 artifact: KernelArtifact | None = None, options: CodegenOptions | None = None,
                 device: torch.device | int | None = None, shared: dict[str, torch.Tensor] | None = None):
        """``shared``: buffers by name taken as they are instead of allocated (another decoder's KV
        cache, for one that runs a smaller batch over the same cache); their shapes must match."""
        from cuda.bindings import driver

        self.schedule, self.spec = schedule, spec
        self.device = torch.device("cuda", torch.cuda.current_device() if device is None else
                                   torch.device(device).index or 0)
        torch.cuda.init()
        with torch.cuda.device(self.device):
            torch.zeros(1, device=self.device)  # make torch create and bind the primary context
            _check(driver.cuInit(0), "cuInit")
            self._cu_device = _check(driver.cuDeviceGet(self.device.index), "cuDeviceGet")
            self._ctx = _check(driver.cuDevicePrimaryCtxRetain(self._cu_device), "cuDevicePrimaryCtxRetain")
            _check(driver.cuCtxSetCurrent(self._ctx), "cuCtxSetCurrent")
            self.artifact = artifact or build_kernel(schedule, spec, options)
            self._module = _check(driver.cuModuleLoadData(self.artifact.cubin), "cuModuleLoadData")
            self._func = _check(driver.cuModuleGetFunction(self._module, self.artifact.kernel_name.encode()),
                                "cuModuleGetFunction")
            self.launch_config = self._configure()
            # weights the kernel reads in tile order (CodegenOptions.weight_layout), reordered once here
            self.tiled = tiled_weights(schedule) if self.artifact.config.weights_tiled else frozenset()
            # GEMV weights whose K is not whole 64-column blocks, stored with zero columns up to them
            self.padded = padded_weights(schedule)
            # router logits with a tagged copy after them (CodegenOptions.tagged_logits)
            self.tagged = routing_logits(schedule) if self.artifact.config.tagged_logits else frozenset()
            self._tags: list[torch.Tensor] = []  # the tagged copies (zero: no step has written them)
            self.scales: dict[str, torch.Tensor] = {}  # FP8 weights' scales (views into their allocations)
            self.buffers = self._allocate(weights, shared or {})
            self.page_size = page_size_of(schedule.buffers)
            if self.page_size:  # sequence b's pages are b * pages_per_seq + j until someone remaps them
                self.buffers["page_table"].copy_(identity_page_table(schedule.batch, schedule.context, self.page_size,
                                                    schedule.buffers["L0.k_cache"].shape[1]))
            words = encode(schedule, self.artifact.config.l2_warm)
            dev = self.device
            self._records = torch.from_numpy(words.records.reshape(-1)).to(dev)
            self._queue_start = torch.from_numpy(words.queue_start).to(dev)
            self._waits = torch.from_numpy(words.waits.reshape(-1)).to(dev)
            table = buffer_table(schedule, words.buffer_names,
                                 {n: self.buffers[n].data_ptr() for n in words.buffer_names}, self.tiled,
                                 self.tagged)
            self._table = torch.from_numpy(table.view(np.uint8).copy()).to(dev)
            rdesc = record_descriptors(words, table)
            self._record_desc = torch.from_numpy(rdesc.view(np.uint8).reshape(-1).copy()).to(dev)
            self._counters = torch.zeros(max(1, words.num_counters), dtype=torch.int32, device=dev)
            self._abort = torch.zeros(ABORT_WORDS, dtype=torch.int32, device=dev)
        self.steps = 0  # steps launched since the last reset
        self.timeout_ns = settings.watchdog_ns()
        self._prof: torch.Tensor | None = None  # [records * _prof_words] int64 %globaltimer, queue order

    # -- set-up ---------------------------------------------------------------------------------
    def _configure(self) -> LaunchConfig:
        from cuda.bindings import driver

        art, sc = self.artifact, self.schedule
        attr = driver.CUdevice_attribute
        sms = _check(driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, self._cu_device),
                     "cuDeviceGetAttribute")
        smem_max = _check(driver.cuDeviceGetAttribute(
            attr.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, self._cu_device), "cuDeviceGetAttribute")
        if sc.num_sms > sms:
            raise CudaError(f"the schedule has {sc.num_sms} persistent CTAs but the GPU has {sms} SMs: "
                            f"compile with --num-sms {sms} or fewer")
        fattr = driver.CUfunction_attribute
        regs = _check(driver.cuFuncGetAttribute(fattr.CU_FUNC_ATTRIBUTE_NUM_REGS, self._func), "cuFuncGetAttribute")
        static = _check(driver.cuFuncGetAttribute(fattr.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, self._func),
                        "cuFuncGetAttribute")
        if art.dynamic_smem + static > smem_max:
            raise CudaError(f"kernel {art.name} needs {art.dynamic_smem + static} B of shared memory per CTA; "
                            f"the GPU allows {smem_max}")
        _check(driver.cuFuncSetAttribute(
            self._func, driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            art.dynamic_smem), "cuFuncSetAttribute")
        per_sm = _check(driver.cuOccupancyMaxActiveBlocksPerMultiprocessor(self._func, art.threads, art.dynamic_smem),
                        "cuOccupancyMaxActiveBlocksPerMultiprocessor")
        if per_sm < 1:
            raise CudaError(f"kernel {art.name} cannot be resident on an SM ({art.threads} threads, {regs} "
                            f"registers, {art.dynamic_smem} B dynamic shared memory): the persistent CTAs "
                            f"would deadlock")
        return LaunchConfig(grid=sc.num_sms, threads=art.threads, dynamic_smem=art.dynamic_smem, regs=regs,
                            static_smem=static)

    def _allocate(self, weights: dict[str, torch.Tensor], shared: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for b in self.schedule.buffers.values():
            dt = TORCH_DTYPES[b.dtype]
            if b.name in shared:
                t = shared[b.name]
                if tuple(t.shape) != tuple(b.shape) or t.dtype != dt or t.device != self.device:
                    raise ValueError(f"shared buffer {b.name}: {tuple(t.shape)} {t.dtype} on {t.device}: expected "
                                     f"{tuple(b.shape)} {dt} on {self.device}")
                out[b.name] = t
            elif b.kind == "weight" and b.dtype == "fp8":
                out[b.name] = self._fp8_matrix(b, weights)
            elif b.kind == "weight" and isinstance(weights, TiledWeights) and b.name in weights.tiled:
                # stored as the kernel reads it already (tile order; zero rows and columns where padded)
                w, want = weights[b.name], stored_shape(b.shape, b.name in self.padded)
                if tuple(w.shape) != want:
                    raise ValueError(f"weight {b.name} as stored has shape {list(w.shape)}: expected {list(want)}")
                out[b.name] = w.to(device=self.device, dtype=dt).contiguous()
            elif b.kind == "weight":
                w = b.given(weights).to(device=self.device, dtype=dt)
                out[b.name] = stored_weight(w, b.name in self.tiled, b.name in self.padded)
            elif b.kind in ("state", "input"):
                out[b.name] = torch.zeros(b.shape, dtype=dt, device=self.device)
            elif b.name in self.tagged:  # the f32 values, then their tagged copy (taskwords.tagged_words)
                n = math.prod(b.shape)
                off, length = tagged_words(n)
                store = torch.zeros(off + length, dtype=torch.float32, device=self.device)
                self._tags.append(store[off:])
                out[b.name] = store[:n].view(b.shape).fill_(float("nan"))
            else:  # act, output: poison, so an element read before it is written shows
                t = torch.empty(b.shape, dtype=dt, device=self.device)
                out[b.name] = t.fill_(-1) if dt == torch.int32 else t.fill_(float("nan"))
        return out

    def _fp8_matrix(self, b, weights: dict[str, torch.Tensor]) -> torch.Tensor:
        """An FP8 weight in one allocation: its e4m3 elements in the FP8 tile order, then its
        float32 scales (mkc/ir/fp8.py: scales_offset), where the kernel finds them. Returns the
        elements' view; the scales' view goes to self.scales."""
        fmt = self.schedule.meta.get("weights", "fp8")
        fp8.check(b.name, b.shape, fmt, weights)  # one clear line for a missing or malformed tensor
        q, s = weights[b.name], weights[b.name + fp8.SCALE_SUFFIX]
        if isinstance(weights, TiledWeights) and b.name in weights.tiled:  # laid out already (fp8_device_weights)
            if (q.device != self.device
                    or s.data_ptr() != q.data_ptr() + fp8.scales_offset(math.prod(b.shape))):
                raise ValueError(f"weight {b.name}: given in tile order, but not with its scales after it on "
                                 f"{self.device}: expected runtime/quantize.py: fp8_device_weights' layout")
            self.scales[b.name] = s
            return q
        data, self.scales[b.name] = fp8_stored(q, s, self.device)
        return data

    # -- running --------------------------------------------------------------------------------
    def logical_weights(self) -> LogicalWeights:
        """The decoder's weights as the lowering lays them out (for the PyTorch prefill); FP8 ones
        dequantised to bf16 on access."""
        names = [n for n, b in self.schedule.buffers.items() if b.kind == "weight"]
        return LogicalWeights(self.buffers, names, self.tiled, self.padded, self.scales)

    def kv_cache(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Live (k, v) views of a layer's cache, [B, kv_heads, ctx, head_dim] bf16 (for a paged
        cache: under the identity page table the decoder starts with; mkc/ir/kv_layout.py)."""
        sc = self.schedule
        return tuple(logical_view(self.buffers[f"L{layer}.{n}"], sc.batch, sc.context, self.page_size)
                     for n in ("k_cache", "v_cache"))  # type: ignore[return-value]

    def launch(self, tokens=None, positions=None, *, profile: bool = False) -> None:
        """Enqueue one decode step on torch's current stream (asynchronous; see check()).

        ``tokens`` / ``positions`` [B] (host or device) are copied into the input buffers first;
        ``None`` reuses what the buffers hold (benchmarks time the kernel alone that way).
        ``profile`` records each task's wait and run times (see timeline()).
        """
        from cuda.bindings import driver

        sc = self.schedule
        for name, values in (("tokens", tokens), ("positions", positions)):
            if values is None:
                continue
            v = torch.as_tensor(values, dtype=torch.int32).reshape(-1)
            if v.numel() != sc.batch:
                raise ValueError(f"step: got {v.numel()} {name}: expected {sc.batch} (the schedule's batch)")
            limit = self.spec.vocab_size if name == "tokens" else sc.context
            if v.device.type == "cpu" and (int(v.min()) < 0 or int(v.max()) >= limit):
                what = "token ids" if name == "tokens" else "positions (the context bucket)"
                raise ValueError(f"step: {name} {v.tolist()} outside [0, {limit}): {what}")
            self.buffers[name].copy_(v, non_blocking=True)
        self.steps += 1
        cfg = self.launch_config
        args = [ctypes.c_void_p(self._records.data_ptr()), ctypes.c_void_p(self._queue_start.data_ptr()),
                ctypes.c_void_p(self._waits.data_ptr()), ctypes.c_void_p(self._table.data_ptr()),
                ctypes.c_void_p(self._record_desc.data_ptr()),
                ctypes.c_void_p(self._counters.data_ptr()), ctypes.c_void_p(self._abort.data_ptr()),
                ctypes.c_uint32(self.steps), ctypes.c_uint64(self.timeout_ns),
                ctypes.c_void_p(self._profile_buffer().data_ptr() if profile else 0)]
        ptrs = (ctypes.c_void_p * len(args))(*(ctypes.addressof(a) for a in args))
        stream = driver.CUstream(torch.cuda.current_stream(self.device).cuda_stream)
        _check(driver.cuLaunchKernel(self._func, cfg.grid, 1, 1, cfg.threads, 1, 1, cfg.dynamic_smem, stream,
                                     ctypes.addressof(ptrs), 0), "cuLaunchKernel")

    def _profile_buffer(self) -> torch.Tensor:
        if self._prof is None:
            self._prof = torch.zeros(self._prof_words * len(self.schedule.tasks), dtype=torch.int64,
                                     device=self.device)
        return self._prof

    @property
    def _prof_words(self) -> int:
        """%globaltimer values per record of a profiled step (kernel.cu.j2: PROF_WORDS)."""
        return len(PROFILE_WORDS) if self.artifact.config.profile_phases else 3

    def timeline(self) -> dict[str, np.ndarray]:
        """Per task of the last profiled step (see launch(profile=True)), in task-id order:
        ``sm``, and ``wait``, ``start``, ``end`` in µs from the earliest wait: the wait for the
        inputs began, the task began running, its counter was signalled. A kernel built with
        CodegenOptions.profile_phases adds ``staged`` (inputs staged; NaN for ops that stage
        none), ``done`` (op done, before the counter's release) and ``routed`` (the task's routing
        derived or found known: expert and routing tasks; NaN for the others), and the phases of a
        routing derived by the task (NaN where there is none): ``opened`` (an expert gate/up
        tile's op entered), ``routing`` (the derivation began), ``logits`` (the tagged logits read,
        all of this step; NaN on the counter path) and ``ranked`` (the TOP_K rounds, or the ranks,
        done). A LINEAR tile that waits inside its op marks its staging's parts instead
        (profile.staging_phases): ``synced`` (every warp through its wait's barrier), ``issued``
        (thread 0's copies issued) and ``landed`` (those copies landed); NaN for other tasks."""
        if self._prof is None:
            raise RuntimeError("timeline(): no profiled step yet (launch(..., profile=True))")
        torch.cuda.current_stream(self.device).synchronize()
        raw = self._prof.view(-1, self._prof_words).cpu().numpy()
        staging = np.array([t.op.name in STAGING_MARK_OPS for t in self.schedule.tasks], dtype=bool)
        return timeline_from_profile(raw, self.schedule.queues, staging)

    def check(self) -> None:
        """Wait for the launched steps and raise StepTimeout if the watchdog fired."""
        torch.cuda.current_stream(self.device).synchronize()
        info = self._abort.tolist()
        if info[0]:
            sc = self.schedule
            task, counter, value, need, sm = info[1:6]
            t = sc.tasks[task] if 0 <= task < len(sc.tasks) else None
            producers = sc.counters[counter].producers if 0 <= counter < len(sc.counters) else ()
            names = ", ".join(sc.tasks[p].name for p in producers[:8]) + (" ..." if len(producers) > 8 else "")
            raise StepTimeout(
                f"decode step {self.steps}: task {task} ({t.name if t else '?'}, {t.op.name if t else '?'}) on "
                f"SM {sm} waited more than {self.timeout_ns / 1e6:.0f} ms on counter {counter} "
                f"(value {value & 0xffffffff}, needed {need & 0xffffffff}; producers: {names}). "
                f"Call reset() before the next step.")

    def step(self, tokens, positions) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step: (logits [B, vocab] float32, next_token [B] int64), on the GPU."""
        self.launch(tokens, positions)
        self.check()
        return self.buffers["logits"].clone(), self.buffers["next_token"].long()

    def close(self) -> None:
        """Unload the module and let go of the buffers (weights, KV cache, activations), so their
        memory is free even while a caller still holds the closed decoder: a loop that makes the
        next decoder before its name lets go of this one would otherwise need two KV caches at once
        (schedule_variants.py at batch 4 and 128K ran out of memory so). Tensors a step returned
        keep their own storage."""
        from cuda.bindings import driver

        if getattr(self, "_module", None) is not None:
            torch.cuda.current_stream(self.device).synchronize()
            _check(driver.cuModuleUnload(self._module), "cuModuleUnload")
            self._module = None
        self.buffers = {}
        self._tags = []

    def reset(self) -> None:
        """Zero the counters, the abort word and the tagged copies' step tags (steps count from 1
        again); the KV cache is kept."""
        torch.cuda.current_stream(self.device).synchronize()
        self._counters.zero_()
        self._abort.zero_()
        for tags in self._tags:
            tags.zero_()
        self.steps = 0
