"""Serving backends: the engine's ``Backend`` over a step decoder that runs the compiled schedule.

A *step decoder* is anything with ``step(tokens [B], positions [B]) -> (logits [B, V], next [B])``
and ``kv_cache(layer) -> (k, v)``, each ``[B, kv_heads, context, head_dim]`` live tensors:
``CpuExecutor`` (the task list on the CPU) and ``CudaDecoder`` (the megakernel) both are.

``DecoderBackend`` adapts one to the engine. The schedule is compiled once for
``batch = max_batch``; each batch row is a slot. A decode step runs every row: rows not in the
step get a dummy token at position 0 (the attention of a row reads only its own row; MoE routing
weights of other rows are zero for it). Prefill is PyTorch (``runtime/prefill.py``): the float32
reference on the CPU backend, the tensor-core ``FastPrefill`` on the CUDA backend; either writes
the slot's cache in place, layer by layer (``prefill_layers``), slab or pages.

Two cache layouts (mkc/ir/kv_layout.py):

* one slab per slot: prefill writes the slab in place; an idle row's position-0 K/V is saved
  before a step and put back after it, so it never changes any slot's cache;
* paged (``page_size`` > 0): a pool of ``kv_pages`` pages per layer plus one scratch page. A slot
  takes pages as its positions grow and gives them back when freed (``PagePool``); an idle row's
  page-table row points at the scratch page, so a step cannot touch any slot's pages. Prefill
  writes and reads the slot's pages through its page list (``PagedKV``). Prefix-cache pages
  are shared by reference (``retain_page`` / ``attach_page`` / ``drop_page``, reference-counted).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch

from mkc.ir.fp8 import weights_choice
from mkc.ir.spec import ModelSpec
from mkc.runtime.prefill import FastPrefill, PagedKV, Prefill, PrefillSteps, SlabKV, SlotKV, run_to_end
from mkc.schedule.plan_cache import cached_plan
from mkc.schedule.schedule import Schedule

log = logging.getLogger("mkc.backend")


class StepDecoder(Protocol):
    def step(self, tokens: Any, positions: Any) -> tuple[torch.Tensor, torch.Tensor]: ...

    def kv_cache(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]: ...


class PagePool:
    """Pages of a paged KV cache, handed to slots as their positions grow: page ``scratch`` (the
    last) is never handed out; an idle row's table points at it."""

    def __init__(self, pages: int, page_size: int, max_batch: int, pages_per_seq: int):
        if pages < 2:
            raise ValueError(f"a paged KV cache of {pages} pages: expected at least one page and the scratch page")
        self.page_size, self.scratch, self.pages_per_seq = page_size, pages - 1, pages_per_seq
        self.free = list(range(pages - 2, -1, -1))  # popped from the end: page 0 first
        self.held: list[list[int]] = [[] for _ in range(max_batch)]
        self.refs = [0] * pages  # holders of each page: slots and prefix-cache entries

    def ensure(self, slot: int, positions: int) -> None:
        """Give ``slot`` pages for positions [0, positions)."""
        need = -(-positions // self.page_size) - len(self.held[slot])
        if need > len(self.free):
            raise RuntimeError(f"KV page pool exhausted: slot {slot} needs {need} more pages of {self.page_size} "
                               f"positions, {len(self.free)} free (the engine's kv_pages must not exceed the pool)")
        for _ in range(max(need, 0)):
            page = self.free.pop()
            self.refs[page] = 1
            self.held[slot].append(page)

    def retain(self, page: int) -> int:
        self.refs[page] += 1
        return page

    def drop(self, page: int) -> None:
        self.refs[page] -= 1
        if self.refs[page] == 0:
            self.free.append(page)

    def attach(self, slot: int, index: int, page: int) -> None:
        """Make ``page`` (held elsewhere, e.g. by the prefix cache) the slot's page ``index``; a
        slot attaches its leading pages in order, before it takes any of its own."""
        if len(self.held[slot]) != index:
            raise ValueError(f"slot {slot} holds {len(self.held[slot])} pages: page {index} cannot be attached")
        self.held[slot].append(self.retain(page))

    def release(self, slot: int) -> None:
        for page in reversed(self.held[slot]):
            self.drop(page)
        self.held[slot] = []

    def row(self, slot: int | None) -> list[int]:
        """A page-table row: the slot's pages then the scratch page (an idle row: scratch only)."""
        pages = self.held[slot] if slot is not None else []
        return pages + [self.scratch] * (self.pages_per_seq - len(pages))


class DecoderBackend:
    """``Backend`` (runtime/engine.py) over a step decoder; also ``read_kv_pages``/``write_kv_pages``
    (the prefix cache's copies, over ``read_kv``/``write_kv``).

    ``weights`` are the decoder's own, by logical name and row-major (same device and dtype as its
    cache; for the CUDA decoder a ``LogicalWeights`` view of its tile-ordered buffers) and feed the
    prefill; ``act_dtype`` is the storage dtype of the decoder's "bf16" activations; ``prefill``
    is "reference" (float32, ``Prefill``) or "fast" (tensor cores, ``FastPrefill``).
    """

    def __init__(self, decoder: StepDecoder, spec: ModelSpec, weights: Mapping[str, torch.Tensor], *,
                 max_batch: int, context: int, act_dtype: torch.dtype, buffers: dict[str, torch.Tensor],
                 prefill: str = "reference", smaller: Sequence[tuple[StepDecoder, dict[str, torch.Tensor]]] = ()):
        self.decoder, self.spec = decoder, spec
        # the step decoders by batch, smallest first: a step runs the smallest that holds its slots
        self._steppers = sorted([(max_batch, decoder, buffers)] + [(int(b["tokens"].numel()), d, b)
                                                                  for d, b in smaller], key=lambda x: x[0])
        self._row = list(range(max_batch))  # slab: the slab row that holds each slot's cache
        self._slot_at = list(range(max_batch))  # slab: the slot whose cache each row holds
        self.max_batch, self.context, self.vocab_size = max_batch, context, spec.vocab_size
        kinds = {"reference": Prefill, "fast": FastPrefill}
        if prefill not in kinds:
            raise ValueError(f"prefill {prefill!r}: expected one of {sorted(kinds)}")
        self._prefill = kinds[prefill](spec, weights, act_dtype=act_dtype)  # type: ignore[arg-type]
        self._pool_kv = [(buffers[f"L{i}.k_cache"], buffers[f"L{i}.v_cache"]) for i in range(spec.num_layers)]
        if "page_table" in buffers:
            self._table = buffers["page_table"]
            page_size = self._pool_kv[0][0].shape[2]
            self.pages: PagePool | None = PagePool(self._pool_kv[0][0].shape[1], page_size, max_batch,
                                                   self._table.shape[1])
            self._kv: list[tuple[torch.Tensor, torch.Tensor]] = []
        else:
            self.pages = None
            self._kv = self._pool_kv  # each [B, G, ctx, D]
        self._pos0: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}  # see _first_positions

    def slot_kv(self, slot: int, end: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (k, v) of positions [0, end) of a slot, [G, end, D]: views of a slab, or
        copies gathered from a paged slot's pages (it must hold pages up to ``end``)."""
        if self.pages is None:
            r = self._row[slot]
            return [(k[r, :, :end], v[r, :, :end]) for k, v in self._kv]
        kv = PagedKV(self._pool_kv, self.pages.held[slot])
        return [kv.read(layer, 0, end) for layer in range(self.spec.num_layers)]

    @property
    def step_batches(self) -> list[int]:
        """The batch sizes of the step decoders, smallest first."""
        return [b for b, _, _ in self._steppers]

    def prefill(self, slot: int, token_ids: Sequence[int], start: int = 0) -> torch.Tensor:
        logits = run_to_end(self.prefill_layers(slot, token_ids, start))
        assert logits is not None
        return logits

    def prefill_layers(self, slot: int, token_ids: Sequence[int], start: int = 0, *,
                       logits: bool = True) -> PrefillSteps:
        """The engine's layered prefill (runtime/engine.py: LayeredBackend): writes the slot's
        cache in place, slab or pages, and yields after each layer."""
        self._check_slot(slot)
        end = start + len(token_ids)
        if end > self.context:
            raise ValueError(f"prefill: positions {start}..{end - 1} exceed the context ({self.context})")
        return self._settled(self._prefill.layers(token_ids, start, self._slot_kv(slot, end), logits=logits))

    def _settled(self, steps: PrefillSteps) -> PrefillSteps:
        """``steps`` as they are: a CPU layer is done when it yields (the CUDA backend waits for it)."""
        return steps

    def _slot_kv(self, slot: int, end: int) -> SlotKV:
        if self.pages is None:
            return SlabKV(_RowLayers(self, slot))
        self.pages.ensure(slot, end)
        return PagedKV(self._pool_kv, self.pages.held[slot])

    def decode(self, slots: Sequence[int], tokens: Sequence[int], positions: Sequence[int]) -> torch.Tensor:
        for s in slots:
            self._check_slot(s)
        if len(set(slots)) != len(slots):
            raise ValueError(f"decode: slots {list(slots)} repeat a slot")
        batch, decoder, buffers = next(x for x in self._steppers if x[0] >= len(slots))
        if self.pages is not None:  # row i reads slot i's pages; idle rows the scratch page
            for s, p in zip(slots, positions, strict=True):
                self.pages.ensure(s, int(p) + 1)
            rows = [self.pages.row(s) for s in slots] + [self.pages.row(None)] * (batch - len(slots))
            buffers["page_table"].copy_(torch.tensor(rows, dtype=torch.int32))
            pad = [0] * (batch - len(slots))
            logits, _ = decoder.step([int(t) for t in tokens] + pad, [int(p) for p in positions] + pad)
            return logits[:len(slots)]
        self._rows_below(slots, batch)
        tok, pos = [0] * batch, [0] * batch
        for s, t, p in zip(slots, tokens, positions, strict=True):
            tok[self._row[s]], pos[self._row[s]] = int(t), int(p)
        # an idle row of the step writes its position 0: put back what the slot there had
        idle = sorted(set(range(batch)) - {self._row[s] for s in slots})
        cache, saved = self._first_positions(idle)
        if cache:
            torch._foreach_copy_(saved, cache)
        logits, _ = decoder.step(tok, pos)
        if cache:
            torch._foreach_copy_(cache, saved)
        return logits[[self._row[s] for s in slots]]

    def _first_positions(self, rows: Sequence[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Position 0 of slab ``rows`` in every layer's k and v cache, a [D] view per KV head, and
        as many rows of a buffer to keep them in: saved and put back in one multi-tensor copy each.
        Both lists are 1-D and contiguous, the condition for CUDA's one-launch ``_foreach_copy_``
        (a [G, D] view at position 0 is not dense, and falls back to a copy per tensor)."""
        cache: list[torch.Tensor] = []
        saved: list[torch.Tensor] = []
        for row in rows:
            if row not in self._pos0:
                views = [t[row, g, 0] for kv in self._kv for t in kv for g in range(t.shape[1])]
                buffer = torch.empty((len(views), views[0].numel()), dtype=views[0].dtype, device=views[0].device)
                self._pos0[row] = views, list(buffer.unbind(0))
            cache += self._pos0[row][0]
            saved += self._pos0[row][1]
        return cache, saved

    def _rows_below(self, slots: Sequence[int], batch: int) -> None:
        """Move the caches of ``slots`` into slab rows below ``batch`` (the rows a step of that
        batch runs), swapping whole rows with slots not in the step; rows already there stay."""
        busy = set(slots)
        for s in slots:
            if self._row[s] < batch:
                continue
            row = next(r for r in range(batch) if self._slot_at[r] not in busy)
            here, other = self._row[s], self._slot_at[row]
            for k, v in self._kv:
                k[[here, row]] = k[[row, here]]
                v[[here, row]] = v[[row, here]]
            self._row[s], self._row[other] = row, here
            self._slot_at[row], self._slot_at[here] = s, other

    def free(self, slot: int) -> None:
        self._check_slot(slot)  # a slab is simply overwritten by the next prefill; pages go back
        if self.pages is not None:
            self.pages.release(slot)

    def read_kv(self, slot: int, start: int, end: int) -> torch.Tensor:
        """[layers, 2, kv_heads, end - start, head_dim] copy of the slot's cache positions."""
        kv = self._slot_kv(slot, end)
        return torch.stack([torch.stack(kv.read(layer, start, end)) for layer in range(self.spec.num_layers)])

    def write_kv(self, slot: int, start: int, kv: torch.Tensor) -> None:
        self._check_slot(slot)
        cache = self._slot_kv(slot, start + kv.shape[3])
        for layer, x in enumerate(kv):
            cache.write(layer, start, x[0].transpose(0, 1), x[1].transpose(0, 1))

    def read_kv_pages(self, slot: int, start: int, page_size: int, n: int) -> list[torch.Tensor]:
        """``n`` pages from position ``start`` (the prefix cache's copies): one read, then each page
        cloned out of it so that it owns its memory."""
        kv = self.read_kv(slot, start, start + n * page_size)
        return [page.clone() for page in kv.split(page_size, dim=3)]

    def write_kv_pages(self, slot: int, start: int, pages: Sequence[torch.Tensor]) -> None:
        self.write_kv(slot, start, torch.cat(list(pages), dim=3))

    # prefix-cache pages by reference (the paged layout; the engine uses them when shares_pages)
    @property
    def shares_pages(self) -> bool:
        return self.pages is not None

    def retain_page(self, slot: int, index: int) -> int:
        """The slot's page ``index`` (a full page), kept alive for the prefix cache until dropped."""
        assert self.pages is not None
        return self.pages.retain(self.pages.held[slot][index])

    def attach_page(self, slot: int, index: int, page: int) -> None:
        """Use a retained page as the slot's page ``index`` (no copy; the slot only reads it: its
        writes start past the pages it attached)."""
        assert self.pages is not None
        self.pages.attach(slot, index, page)

    def drop_page(self, page: int) -> None:
        assert self.pages is not None
        self.pages.drop(page)

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.max_batch:
            raise ValueError(f"slot {slot}: expected 0..{self.max_batch - 1}")


class _RowLayers:
    """A slot's slab layers for SlabKV, layer i's (k, v) taken from the slot's row at every read and
    write: a decode step between two layers of a prefill in flight may move the slot to another row
    (``_rows_below``), and views taken once would then write into the row of the stream moved there."""

    def __init__(self, backend: DecoderBackend, slot: int):
        self._backend, self._slot = backend, slot

    def __getitem__(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        r = self._backend._row[self._slot]
        k, v = self._backend._kv[layer]
        return k[r], v[r]


def compile_schedule(spec: ModelSpec, max_batch: int, context: int, num_sms: int, page_size: int = 0,
                     kv_pages: int = 0, weights: str = "bf16") -> Schedule:
    """The backend's schedule, from the schedule cache where it was planned before
    (mkc/schedule/plan_cache.py); a paged cache gets ``kv_pages`` pages plus the scratch page;
    ``weights``: the weight format (mkc/ir/fp8.py)."""
    t0 = time.monotonic()
    sc, cached = cached_plan(spec, max_batch, context, num_sms, page_size=page_size,
                             kv_pages=kv_pages + 1 if page_size and kv_pages else 0, **weights_choice(weights))
    log.info("schedule (batch %d, context %d) %s in %.1f s", max_batch, context,
             "read from the schedule cache" if cached else "planned", time.monotonic() - t0)
    return sc


def step_batches(max_batch: int, batches: Sequence[int] | None) -> list[int]:
    """The batch sizes a backend keeps a step decoder for: ``batches`` (default the powers of two
    below ``max_batch``) and ``max_batch`` itself, ascending; raises ValueError on a size outside
    1..max_batch."""
    chosen = [b for b in (1, 2, 4) if b < max_batch] if batches is None else list(batches)
    bad = [b for b in chosen if not 1 <= b <= max_batch]
    if bad:
        raise ValueError(f"step batch sizes {bad}: expected sizes from 1 to the max batch ({max_batch})")
    return sorted(set(chosen) | {max_batch})


def _kv_buffers(buffers: dict[str, torch.Tensor], batch: int, paged: bool) -> dict[str, torch.Tensor]:
    """A smaller step decoder's share of the largest one's KV cache: the whole page pool, or the
    slab's first ``batch`` rows."""
    return {n: t if paged else t[:batch] for n, t in buffers.items() if n.endswith(("k_cache", "v_cache"))}


class CpuBackend(DecoderBackend):
    """The CPU executor, without the oracle's weight poison and NaN scan (serving, not checking);
    an executor for each of ``batches`` (see step_batches) over one KV cache."""

    def __init__(self, spec: ModelSpec, weights: dict[str, torch.Tensor], *, max_batch: int = 8,
                 context: int = 512, num_sms: int = 8, dtype: torch.dtype = torch.float32, page_size: int = 0,
                 kv_pages: int = 0, prefill: str = "reference", batches: Sequence[int] | None = None,
                 weights_format: str = "bf16"):
        from mkc.schedule.executor import CpuExecutor

        sizes = step_batches(max_batch, batches)
        sc = compile_schedule(spec, max_batch, context, num_sms, page_size, kv_pages, weights_format)
        if weights_format != "bf16":
            from mkc.runtime.quantize import fp8_weights

            weights = fp8_weights(weights, sc.buffers, weights_format)
        self.exe = CpuExecutor(sc, spec, weights, dtype=dtype, poison_weights=False, check=False)
        smaller = []
        for b in sizes[:-1]:
            exe = CpuExecutor(compile_schedule(spec, b, context, num_sms, page_size, kv_pages, weights_format), spec,
                              self.exe.weights if weights_format == "bf16" else weights,
                              dtype=dtype, poison_weights=False, check=False)
            for name, t in _kv_buffers(self.exe.bufs, b, bool(page_size)).items():
                assert exe.bufs[name].shape == t.shape, f"{name}: {tuple(exe.bufs[name].shape)} vs {tuple(t.shape)}"
                exe.bufs[name] = t  # the executor reads its buffers by name at every task
            smaller.append((exe, exe.bufs))
        super().__init__(self.exe, spec, self.exe.weights, max_batch=max_batch, context=context, act_dtype=dtype,
                         buffers=self.exe.bufs, prefill=prefill, smaller=smaller)


class CudaBackend(DecoderBackend):
    """The megakernel (``runtime/cuda_backend.py: CudaDecoder``) on the current CUDA device, bf16.

    ``num_sms`` defaults to every SM of the device. A kernel for each of ``batches`` (see
    step_batches) shares the weights and the KV cache: a step runs the smallest that holds its
    streams, so a lone stream decodes at the batch-1 speed. Prompts go through ``FastPrefill`` unless
    ``prefill`` says "reference". Weights already on the GPU are taken over: the GEMV weights are
    reordered into tile order in their own storage, so the model is held once (the caller must not
    read them row-major afterwards); host weights are moved one at a time.
    """

    def __init__(self, spec: ModelSpec, weights: dict[str, torch.Tensor], *, max_batch: int = 8,
                 context: int = 4096, num_sms: int | None = None, page_size: int = 0, kv_pages: int = 0,
                 prefill: str = "fast", batches: Sequence[int] | None = None, weights_format: str = "bf16"):
        from mkc.codegen import build_kernel
        from mkc.codegen.weight_tiles import TiledWeights, padded_weights, tiled_weights, to_tiles
        from mkc.ir.fp8 import SCALE_SUFFIX
        from mkc.runtime.cuda_backend import CudaDecoder

        if num_sms is None:
            num_sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
        t0 = time.monotonic()
        schedule = compile_schedule(spec, max_batch, context, num_sms, page_size, kv_pages, weights_format)
        artifact = build_kernel(schedule, spec, None)
        log.info("schedule and kernel %s (batch %d, context %d) in %.1f s", artifact.name, max_batch, context,
                 time.monotonic() - t0)
        t0 = time.monotonic()
        fp8_names: list[str] = []
        if weights_format != "bf16":  # quantised on their device, one matrix at a time, each bf16 source freed
            from mkc.runtime.quantize import fp8_device_weights

            names = [n for n, b in schedule.buffers.items() if b.kind == "weight" and b.dtype == "fp8"]
            weights = fp8_device_weights(weights, names, weights_format)
            fp8_names = list(weights.tiled)
        if artifact.config.weights_tiled and all(t.is_cuda for t in weights.values()):
            padded = padded_weights(schedule)  # stored with zero columns: the decoder makes a copy
            names = [n for n in tiled_weights(schedule) if n in weights and n not in padded and n not in fp8_names]
            for n in names:
                weights[n].copy_(to_tiles(weights[n]))
            weights = TiledWeights(weights, [*names, *fp8_names])
        self.dec = CudaDecoder(schedule, spec, weights, artifact=artifact)
        log.info("weights on the GPU in tile order, KV cache and buffers allocated in %.1f s", time.monotonic() - t0)
        held = TiledWeights({n: t for n, t in self.dec.buffers.items() if n in weights},
                            self.dec.tiled | set(self.dec.padded))
        held.update({n + SCALE_SUFFIX: s for n, s in self.dec.scales.items()})
        smaller = []
        for b in step_batches(max_batch, batches)[:-1]:  # the same weights and KV cache, a smaller step
            t0 = time.monotonic()
            sc = compile_schedule(spec, b, context, num_sms, page_size, kv_pages, weights_format)
            dec = CudaDecoder(sc, spec, held, shared=_kv_buffers(self.dec.buffers, b, bool(page_size)))
            log.info("kernel %s (batch %d) in %.1f s", dec.artifact.name, b, time.monotonic() - t0)
            smaller.append((dec, dec.buffers))
        super().__init__(self.dec, spec, self.dec.logical_weights(), max_batch=max_batch,
                         context=context, act_dtype=torch.bfloat16, buffers=self.dec.buffers, prefill=prefill,
                         smaller=smaller)
        if isinstance(self._prefill, FastPrefill):
            self._warm_prefill()

    def _warm_prefill(self) -> None:
        """One chunk of the tensor-core prefill into slot 0, freed again: its first call pays the
        libraries' set-up (cuBLAS, the grouped GEMM, SDPA), seconds that would otherwise land on
        the first user's time to first token."""
        t0 = time.monotonic()
        n = min(self.context, self._prefill.chunk)
        if self.pages is not None:
            n = min(n, len(self.pages.free) * self.pages.page_size)
        self.prefill(0, [0] * n)
        self.free(0)
        log.info("prefill warmed up (%d tokens) in %.1f s", n, time.monotonic() - t0)

    def _settled(self, steps: PrefillSteps) -> PrefillSteps:
        """Each layer finished on the GPU before it yields, so the engine's clock times real work."""
        stream = torch.cuda.current_stream(self.dec.device)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                return done.value
            stream.synchronize()
            yield
