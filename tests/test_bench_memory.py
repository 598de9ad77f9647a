"""``mkc bench``'s device-memory estimate and the points it skips (runtime/bench.py), on the CPU:
the free-memory query and the two timed engines are monkeypatched, so no GPU is needed."""

from __future__ import annotations

import inspect
import json
import math
from types import SimpleNamespace

import pytest
import torch

from mkc.ir.lower import lower
from mkc.runtime import bench
from mkc.runtime.bench import (
    MEMORY_MARGIN,
    Row,
    Skip,
    format_rounds,
    format_table,
    in_turn,
    memory_estimate,
    memory_skip,
    write_json,
)

GB = 1e9
H200 = 141 * GB  # the weights and everything else share it


@pytest.mark.parametrize("page_size", [0, 4, 12])
def test_estimate_is_the_lowered_buffers(tiny, page_size):
    """Weights and the megakernel's KV cache (pool and page table when paged) are exactly the bytes
    of the buffers the lowering declares, for a page size that divides the context and one that
    does not."""
    prog = lower(tiny, batch=3, context=40, num_sms=8, page_size=page_size)
    est = memory_estimate(tiny, 3, 40, page_size)
    assert est.weights == sum(b.nbytes for b in prog.buffers.values() if b.kind == "weight")
    kv = sum(b.nbytes for n, b in prog.buffers.items() if n.endswith("_cache") or n == "page_table")
    assert est.kv_cache == kv
    assert est.kv_cache >= est.baseline_kv_cache  # a full pool is never smaller than the slab


def test_north_mini_code_on_an_h200(nmc):
    """61 GB of bf16 weights; 2 (K, V) x 4 KV heads x 128 x 2 bytes per position and layer, 49
    layers. Batch 8 at 128K positions does not fit in 141 GB in either layout; the rest does."""
    est = memory_estimate(nmc, 8, 131072)
    assert 60 * GB < est.weights < 62 * GB
    assert est.kv_cache == est.baseline_kv_cache == 49 * 8 * 131072 * (2 * 4 * 128 * 2)
    assert est.weights + est.megakernel > H200 and est.total > H200
    assert memory_estimate(nmc, 8, 131072, page_size=256).weights + memory_estimate(
        nmc, 8, 131072, page_size=256).megakernel > H200
    for batch, context in [(1, 8192), (1, 32768), (1, 131072), (8, 8192), (8, 32768)]:
        for page_size in (0, 256):
            assert memory_estimate(nmc, batch, context, page_size).total < H200, (batch, context, page_size)


def test_baseline_needs_its_attention_scratch(nmc):
    """The baseline's SDPA math fallback widens one layer's K and V to fp32 per query head."""
    est = memory_estimate(nmc, 1, 8192)
    assert est.attention_scratch == 8192 * 128 * 4 * (2 * 4 + 3 * 32)
    assert est.baseline == est.baseline_kv_cache + est.attention_scratch + MEMORY_MARGIN
    assert est.total == est.weights + est.baseline


def test_memory_skip_says_what_was_needed_and_free(nmc):
    est = memory_estimate(nmc, 8, 131072)
    assert memory_skip(est, "mkc", free=200 * GB) is None
    why = memory_skip(est, "mkc", free=80 * GB)
    assert why.startswith("mkc needs 106.3 GB beside the 61.0 GB of weights (KV cache 105.2 GB")
    assert why.endswith("80.0 GB free")
    why = memory_skip(est, "torch+graph", free=80 * GB)
    assert "KV cache 105.2 GB + attention scratch 55.8 GB" in why and "162.1 GB" in why


def test_paged_skip_names_the_contiguous_layout_when_it_fits(tiny):
    """A page that does not divide the context rounds every sequence up to whole pages: where that
    no longer fits and the contiguous cache would, the reason says so."""
    paged, contiguous = memory_estimate(tiny, 8, 40, page_size=32), memory_estimate(tiny, 8, 40)
    assert paged.kv_cache > contiguous.kv_cache
    free = (paged.megakernel + contiguous.megakernel) // 2
    why = memory_skip(paged, "mkc", free, contiguous)
    assert why is not None and "contiguous KV cache (--page-size 0)" in why and "fits" in why
    assert "--page-size 0" not in memory_skip(paged, "mkc", contiguous.megakernel - 1, contiguous)


class FakeGPU:
    """torch.cuda's free-memory query and the two timed engines, faked: ``free`` bytes free; a timed
    engine is recorded and returns a row (or raises ``fail``)."""

    def __init__(self, monkeypatch, free: float, fail: dict | None = None):
        self.free, self.fail, self.ran = int(free), fail or {}, []
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (self.free, int(H200)))
        monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a: SimpleNamespace(multi_processor_count=132))
        monkeypatch.setattr(bench, "measure_read_bandwidth", lambda: 4e12)
        for name, engine in (("_megakernel_row", "mkc"), ("_baseline_row", "torch+graph")):
            monkeypatch.setattr(bench, name, self._fake(getattr(bench, name), engine))

    def _fake(self, real, engine: str):
        """A stand-in for ``real`` that takes only the arguments ``real`` takes."""
        def run(*args, **kw):
            bound = inspect.signature(real).bind(*args, **kw)
            return self._run(engine, bound.arguments["batch"], bound.arguments["context"])
        return run

    def _run(self, engine: str, batch: int, context: int) -> Row:
        if (engine, batch, context) in self.fail:
            raise self.fail[(engine, batch, context)]
        self.ran.append((engine, batch, context))
        return bench.row(engine, batch, context, [1e-3], 10**9, 4e12)


def test_points_that_do_not_fit_are_skipped_and_the_rest_run(nmc, monkeypatch, tmp_path):
    """Batch 1 and 8 at 8K, 32K and 128K on an H200 with the weights loaded (80 GB free): batch 8
    at 128K is skipped for both engines with what each needed; every other point runs."""
    gpu = FakeGPU(monkeypatch, free=H200 - 61 * GB)
    log = []
    out = bench.run_bench(nmc, {}, [1, 8], [8192, 32768, 131072], reps=1, log=log.append)
    skipped = [r for r in out if isinstance(r, Skip)]
    assert [(s.engine, s.batch, s.context) for s in skipped] == [("mkc", 8, 131072), ("torch+graph", 8, 131072)]
    est = memory_estimate(nmc, 8, 131072)
    assert [s.needed for s in skipped] == [est.megakernel, est.baseline]
    assert all(s.free == gpu.free for s in skipped)
    want = [(e, b, c) for b in (1, 8) for c in (8192, 32768, 131072) for e in ("mkc", "torch+graph")
            if (b, c) != (8, 131072)]
    assert gpu.ran == want
    assert sum("skipped: mkc needs 106.3 GB" in line for line in log) == 1
    table = format_table(out)
    assert "skipped: needs 106.3 GB beside the weights, 80.0 GB free" in table
    assert len(table.splitlines()) == 2 + 12
    write_json(out, tmp_path / "bench.json", {})
    d = json.loads((tmp_path / "bench.json").read_text())
    assert len(d["rows"]) == 10 and [s["engine"] for s in d["skipped"]] == ["mkc", "torch+graph"]
    assert d["skipped"][0]["needed"] == est.megakernel and d["skipped"][0]["free"] == gpu.free
    assert "80.0 GB free" in d["skipped"][0]["reason"]


def test_baseline_alone_can_be_skipped(nmc, monkeypatch):
    """The megakernel fits where the baseline (its attention scratch too) does not: only the baseline
    is skipped, and the megakernel's row is kept."""
    est = memory_estimate(nmc, 8, 32768)
    gpu = FakeGPU(monkeypatch, free=(est.megakernel + est.baseline) // 2)
    out = bench.run_bench(nmc, {}, [8], [32768], reps=1, log=lambda s: None)
    assert isinstance(out[0], Row) and out[0].engine == "mkc"
    assert isinstance(out[1], Skip) and out[1].engine == "torch+graph" and "attention scratch" in out[1].reason
    assert gpu.ran == [("mkc", 8, 32768)]


def test_out_of_memory_anyway_is_a_skip(nmc, monkeypatch):
    """An engine that runs out of memory although its estimate fit is skipped too, and the next
    engine and point still run."""
    oom = torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore detail")
    gpu = FakeGPU(monkeypatch, free=H200 - 61 * GB, fail={("mkc", 1, 8192): oom})
    out = bench.run_bench(nmc, {}, [1], [8192, 32768], reps=1, log=lambda s: None)
    assert isinstance(out[0], Skip) and "ran out of device memory" in out[0].reason
    assert out[0].reason.endswith("Tried to allocate 2.00 GiB")
    assert gpu.ran == [("torch+graph", 1, 8192), ("mkc", 1, 32768), ("torch+graph", 1, 32768)]


def test_bench_refuses_weights_that_do_not_fit(nmc, monkeypatch, capsys):
    """Before it makes the weights, mkc bench checks they fit: one clear error, no allocation."""
    import mkc.runtime.cuda_backend as cb

    FakeGPU(monkeypatch, free=40 * GB)
    monkeypatch.setattr(cb, "cuda_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA A100-SXM4-40GB")
    monkeypatch.setattr(bench, "device_random_weights", lambda *a: pytest.fail("weights made anyway"))
    a = SimpleNamespace(config="configs/north_mini_code.yaml", batch=[1], context=[8192], page_size=0,
                        checkpoint=None, seed=0, output="unused", reps=1, profile=False)
    assert bench.bench_main(a) == 2
    err = capsys.readouterr().err
    assert "weights of north_mini_code (61.0 GB in bf16) do not fit in the 40.0 GB free" in err
    assert math.isclose(memory_estimate(nmc, 1, 8192).weights / GB, 61.0, abs_tol=0.05)


def test_decoder_in_place_holds_the_weights_once(tiny, monkeypatch):
    """The variant scripts and ``mkc bench`` build each decoder over the weights reordered in their
    own storage: the decoder gets the very tensors in tile order, they are row-major again after
    the block, and the decoder is closed even when the block fails. CudaDecoder and the kernel
    build are replaced by fakes, so no GPU is needed."""
    from mkc.codegen import weight_tiles
    from mkc.runtime import cuda_backend
    from mkc.runtime.weights import random_weights
    from mkc.schedule.scheduler import schedule

    sc = schedule(lower(tiny, batch=1, context=16, num_sms=8), tiny.name)
    weights = random_weights(tiny, seed=1, dtype=torch.float32)
    row_major = {n: w.clone() for n, w in weights.items()}
    name = min(weight_tiles.tiled_weights(sc))
    seen = {}

    class FakeDecoder:
        def __init__(self, sc, spec, w, artifact):
            seen["same storage"] = w[name].data_ptr() == row_major_ptr
            seen["tiled"] = torch.equal(w[name], weight_tiles.to_tiles(row_major[name]))
            seen["listed"] = name in w.tiled
            self.closed = False
            seen["decoder"] = self

        def close(self):
            self.closed = True

    art = SimpleNamespace(config=SimpleNamespace(weights_tiled=True))
    monkeypatch.setattr(cuda_backend, "CudaDecoder", FakeDecoder)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    row_major_ptr = weights[name].data_ptr()
    with pytest.raises(RuntimeError, match="timing failed"), bench.decoder_in_place(sc, tiny, weights, artifact=art):
        raise RuntimeError("timing failed")
    assert seen == {"same storage": True, "tiled": True, "listed": True, "decoder": seen["decoder"]}
    assert seen["decoder"].closed
    assert all(torch.equal(weights[n], row_major[n]) for n in weights), "weights not row-major after the block"


def test_rounds_side_by_side_give_each_mean_against_the_first():
    """kernel_variants.py's summary: each variant's rounds in the order run, their mean, and the
    mean's change against the first variant (the 2026-12-06 09:23 UTC batch-1 run, BENCHMARKS.md)."""
    out = format_rounds(1, {"default": [2850.9, 2848.1, 2838.4, 2846.8],
                            "logits-ahead": [2883.4, 2875.2, 2874.9, 2886.4]})
    lines = out.splitlines()
    assert lines[0].startswith("batch 1 side by side") and "against default" in lines[0]
    assert lines[1].split() == ["default", "2850.9", "/", "2848.1", "/", "2838.4", "/", "2846.8", "mean", "2846.1"]
    assert lines[2].split()[-3:] == ["mean", "2880.0", "+1.2%"]
    assert format_rounds(4, {}) == format_rounds(4, {"default": []}) == "batch 4: no variant timed"


def test_rounds_alternate_their_order():
    """in_turn: A B, then B A, so a place in the round weighs on every variant alike."""
    assert in_turn(["a", "b", "c"], 3) == ["a", "b", "c", "c", "b", "a", "a", "b", "c"]


def test_each_weight_format_keeps_its_own_profile_trace():
    """`mkc bench --weights bf16,fp8 --profile` writes one trace per format at a point (the FP8 one
    used to overwrite the bf16 one); bf16's keeps the name calibrate_models.py and docs/profiling.md use."""
    names = {w: bench.trace_name(1, 8192, w) for w in ("bf16", "fp8", "fp8-block")}
    assert names["bf16"] == "trace-b1-c8192.json"
    assert len(set(names.values())) == 3
