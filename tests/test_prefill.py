"""The tensor-core prefill (FastPrefill) against the float32 reference (Prefill) on the CPU: the
same K/V and logits, whole or in chunks, slab or paged, over row-major or tile-ordered weights,
for every tiny family (parallel and sequential blocks, sliding windows, qk-norm, both routers).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import rel_err

from mkc.codegen.weight_tiles import to_tiles
from mkc.ir.spec import load_spec
from mkc.runtime.cuda_backend import LogicalWeights
from mkc.runtime.prefill import FastPrefill, PagedKV, Prefill, SlabKV, run_to_end
from mkc.runtime.weights import random_weights

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
FAMILIES = ["tiny.yaml", "qwen3_moe_tiny.yaml", "llama_tiny.yaml", "mixtral_tiny.yaml"]
CONTEXT = 96
PROMPT = 70  # past the tiny sliding windows (8): the key-blocked path runs
# float32: the two sum in different orders (one SDPA vs explicit scores, grouped vs per-expert
# GEMMs); seen at most 1.6e-6 on K/V of magnitude ~1
F32_ATOL = 1e-5
# bf16: FastPrefill also rounds the expert gate/up product and each expert's output to bf16 (2^-9
# relative) where the reference keeps them float32, and those ulps compound over the layers: seen
# 8e-3 relative error per position at the 95th percentile (median 4e-3). MoE routing is not continuous: a near-tie flipped by that
# rounding sends a token to another expert (seen: one position of 70 at 20% in mixtral_tiny), so
# bf16 K/V are compared per position and up to 5% of positions may be off; a wrong result is
# off at every position.
BF16_RTOL = 2e-2
FLIPPED_SHARE = 0.05


def _cache(spec, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    a = spec.attention
    return [tuple(torch.zeros(a.num_kv_heads, CONTEXT, a.head_dim, dtype=dtype) for _ in range(2))
            for _ in range(spec.num_layers)]  # type: ignore[misc]


def _prompt(spec) -> list[int]:
    return torch.randint(0, spec.vocab_size, (PROMPT,), generator=torch.Generator().manual_seed(3)).tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("config", FAMILIES)
def test_fast_prefill_matches_reference(config, dtype):
    spec = load_spec(CONFIGS / config)
    w = random_weights(spec, 0, dtype)
    ids = _prompt(spec)
    want_kv, got_kv = _cache(spec, dtype), _cache(spec, dtype)
    want = Prefill(spec, w, act_dtype=dtype).run(ids, 0, want_kv)
    fast = FastPrefill(spec, w, act_dtype=dtype, chunk=32, query_block=16)
    fast.run(ids[:40], 0, got_kv)  # a chunk, then the rest after it: positions continue
    got = fast.run(ids[40:], 40, got_kv)
    for layer, (a, b) in enumerate(zip(want_kv, got_kv, strict=True)):
        for name, x, y in (("k", a[0], b[0]), ("v", a[1], b[1])):
            x, y = x[:, :PROMPT].float(), y[:, :PROMPT].float()
            if dtype == torch.float32:
                err = (x - y).abs().max().item()
                assert err <= F32_ATOL, f"layer {layer} {name}: max error {err:.2e} > {F32_ATOL:.0e}"
            else:  # per position: [heads, positions, dim] -> [positions]
                err = (x - y).norm(dim=(0, 2)) / x.norm(dim=(0, 2)).clamp_min(1e-30)
                off = int((err > BF16_RTOL).sum())
                assert off <= FLIPPED_SHARE * PROMPT, (f"layer {layer} {name}: {off} of {PROMPT} positions off by "
                                                       f"more than {BF16_RTOL:.0e} (worst {err.max():.2e})")
    err = rel_err(want, got)
    assert err <= (F32_ATOL if dtype == torch.float32 else BF16_RTOL), f"logits: relative error {err:.2e}"


def test_paged_cache_equals_slab():
    """Pages in a scrambled order of a pool hold what the slab holds, position for position."""
    spec = load_spec(CONFIGS / "tiny.yaml")
    w = random_weights(spec, 1, torch.float32)
    a, page = spec.attention, 8
    order = torch.randperm(CONTEXT // page + 3, generator=torch.Generator().manual_seed(5)).tolist()
    pools = [tuple(torch.zeros(a.num_kv_heads, len(order), page, a.head_dim) for _ in range(2))
             for _ in range(spec.num_layers)]
    paged = PagedKV(pools, order[:CONTEXT // page])  # type: ignore[arg-type]
    slab = SlabKV(_cache(spec, torch.float32))
    fast = FastPrefill(spec, w, act_dtype=torch.float32, chunk=24, query_block=16)
    ids = _prompt(spec)
    assert torch.equal(fast.run(ids, 0, paged), fast.run(ids, 0, slab))
    for layer in range(spec.num_layers):
        for x, y in zip(paged.read(layer, 0, PROMPT), slab.read(layer, 0, PROMPT), strict=True):
            assert torch.equal(x, y)


def test_logical_weights_read_tile_order_back():
    """The CUDA backend's weight view: whole matrices and expert stacks, and embedding rows,
    read back from tile order exactly."""
    g = torch.Generator().manual_seed(2)
    embed, stack = torch.randn(64, 128, generator=g), torch.randn(3, 32, 64, generator=g)
    lw = LogicalWeights({"embed": to_tiles(embed), "stack": to_tiles(stack)}, ["embed", "stack"],
                        frozenset({"embed", "stack"}))
    assert torch.equal(lw.matrix("embed"), embed) and torch.equal(lw.matrix("stack"), stack)
    ids = torch.tensor([0, 17, 63, 17, 5])
    assert torch.equal(lw.rows("embed", ids), embed[ids])


def test_fast_prefill_over_tile_ordered_weights():
    """FastPrefill reading the weights through LogicalWeights (the GPU's tile order) computes
    exactly what it computes over the row-major weights."""
    spec = load_spec(CONFIGS / "tiny.yaml")
    w = random_weights(spec, 2, torch.float32)
    tileable = {n for n, t in w.items() if t.dim() >= 2 and t.shape[-2] % 16 == 0 and t.shape[-1] % 64 == 0}
    assert {"embed", "L1.w_experts_gate_up", "L0.w_qkv"} <= tileable
    lw = LogicalWeights({n: to_tiles(t) if n in tileable else t for n, t in w.items()}, list(w), frozenset(tileable))
    ids = _prompt(spec)
    plain = FastPrefill(spec, w, act_dtype=torch.float32).run(ids, 0, _cache(spec, torch.float32))
    tiled = FastPrefill(spec, lw, act_dtype=torch.float32).run(ids, 0, _cache(spec, torch.float32))  # type: ignore[arg-type]
    assert torch.equal(plain, tiled)


def test_mlp_matrices_read_back_on_a_second_stream_are_waited_for(monkeypatch):
    """On a GPU, FastPrefill reads each layer's MLP matrices back from tile order on a second
    stream while the layer's attention runs. Here CUDA's streams and events are stand-ins that log
    what is called: every matrix read on the copy stream is waited for by the compute stream and
    kept alive for it before the compute stream uses it, the copy stream first waits for the work
    queued before (a decode step), and the result is the one-stream result bit for bit."""
    import contextlib

    spec = load_spec(CONFIGS / "tiny.yaml")
    w = random_weights(spec, 2, torch.float32)
    tileable = {n for n, t in w.items() if t.dim() >= 2 and t.shape[-2] % 16 == 0 and t.shape[-1] % 64 == 0}
    lw = LogicalWeights({n: to_tiles(t) if n in tileable else t for n, t in w.items()}, list(w), frozenset(tileable))
    log: list[tuple] = []
    current: list[str] = ["compute"]

    class Stream:
        def __init__(self, name: str = "copies", device=None):
            self.name, self.device = name, device

        def wait_stream(self, other):
            log.append(("wait_stream", self.name, other.name))

        def record_event(self):
            log.append(("event", self.name, len(log)))
            return log[-1]

        def wait_event(self, event):
            log.append(("wait_event", self.name, event))

    compute = Stream("compute")

    @contextlib.contextmanager
    def on(stream):
        current.append(stream.name)
        yield
        current.pop()

    def matrix(name, _read=LogicalWeights.matrix):
        log.append(("read", name, current[-1]))
        return _read(lw, name)

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: compute)
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "stream", on)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda t, stream: log.append(("keep", stream.name)))
    monkeypatch.setattr(lw, "matrix", matrix)
    real_weight = FastPrefill._weight
    monkeypatch.setattr(FastPrefill, "_weight", lambda self, name: (real_weight(self, name), log.append(("use", name)))[0])
    ids = _prompt(spec)
    plain = FastPrefill(spec, w, act_dtype=torch.float32, chunk=8).run(ids, 0, _cache(spec, torch.float32))
    log.clear()
    fast = FastPrefill(spec, lw, act_dtype=torch.float32, chunk=8)  # type: ignore[arg-type]
    fast._gpu = True
    assert torch.equal(fast.run(ids, 0, _cache(spec, torch.float32)), plain)
    for i in range(spec.num_layers):
        names = fast._mlp_matrices(i)
        for name in names:
            read = next(k for k, e in enumerate(log) if e[:2] == ("read", name))
            event = log[read + 1]
            assert log[read][2] == "copies" and event[:2] == ("event", "copies"), f"{name}: not read on the copy stream"
            waited = log.index(("wait_event", "compute", event))
            assert log[waited + 1] == ("keep", "compute"), f"{name}: its memory not kept for the compute stream"
            assert waited < log.index(("use", name)), f"{name}: used before the compute stream waited for its copy"
        first_read = next(k for k, e in enumerate(log) if e[:2] == ("read", names[0]))
        assert log[first_read - 1] == ("wait_stream", "copies", "compute"), "the copy did not wait for queued work"


def _count_yields(steps) -> tuple[int, object]:
    yields = 0
    while True:
        try:
            next(steps)
            yields += 1
        except StopIteration as done:
            return yields, done.value


def test_layers_yield_once_a_layer_and_check_up_front():
    spec = load_spec(CONFIGS / "tiny.yaml")
    w = random_weights(spec, 0, torch.float32)
    fast = FastPrefill(spec, w, act_dtype=torch.float32, chunk=32)
    with pytest.raises(ValueError, match="exceed the context"):
        fast.layers(list(range(CONTEXT)), 1, _cache(spec, torch.float32))  # raises at the call
    # layer-major: a yield a layer, however many chunks of 32 positions a layer takes
    yields, value = _count_yields(fast.layers(list(range(40)), 0, _cache(spec, torch.float32), logits=False))
    assert (yields, value) == (spec.num_layers, None)  # logits=False: a chunk before the prompt's last
    # the reference runs chunk by chunk: a yield per layer of each chunk
    yields, value = _count_yields(Prefill(spec, w, chunk=32).layers(list(range(40)), 0, _cache(spec, torch.float32)))
    assert yields == 2 * spec.num_layers and value.shape == (spec.vocab_size,)
    assert run_to_end(fast.layers([1, 2, 3], 0, _cache(spec, torch.float32))).shape == (spec.vocab_size,)


def test_every_attention_way_the_benchmark_times_is_right(tmp_path):
    """benchmarks/prefill_attention.py times FastPrefill's attention beside candidates to replace
    it: each must compute the same attention before its time means anything. On small shapes (a
    window of 128, query blocks of 128 and 64, so the band and the block edges are crossed), every
    way is within 1e-2 of float32 attention over the first and last queries: bf16 outputs give
    about 2e-3, and a band one key too wide gives 9e-2."""
    import json

    from conftest import load_benchmark

    out = tmp_path / "attention.json"
    assert load_benchmark("prefill_attention").main(
        ["--device", "cpu", "--prompts", "600", "--chunk", "300", "--window", "128", "--blocks", "128,64",
         "-o", str(out)]) == 0
    cases = json.loads(out.read_text())["cases"]
    assert {c["kind"] for c in cases} == {"sliding", "global"}
    for case in cases:
        assert len(case["ways"]) >= 3
        for name, row in case["ways"].items():
            assert "error" not in row, f"{case['kind']} {name}: {row['error']}"
            assert row["rel_err"] <= 1e-2, f"{case['kind']} {name}: error {row['rel_err']:.3g} > 1e-2"


def test_prefill_profile_counts_each_kernel_once():
    """benchmarks/prefill_speed.py --profile: the GPU total sums device rows only. A kernel shows up
    on its CUDA row and again as the self device time of the aten op that launched it, and a user
    annotation's device row spans kernels already counted: summing every row gave 3x here."""
    from types import SimpleNamespace

    from conftest import load_benchmark
    from torch.autograd import DeviceType

    def row(device, us, annotation=False):
        return SimpleNamespace(device_type=device, self_device_time_total=us, is_user_annotation=annotation)

    events = [row(DeviceType.CUDA, 300.0), row(DeviceType.CUDA, 200.0),  # two kernels
              row(DeviceType.CPU, 500.0),  # the aten op that launched them
              row(DeviceType.CUDA, 500.0, annotation=True)]  # a record_function around both
    assert load_benchmark("prefill_speed")._device_ms(events) == 0.5


def test_prefill_speed_stream_use_finds_the_idle_time_and_gaps():
    """benchmarks/prefill_speed.py's trace summary: two streams' kernels (overlapping within a
    stream and across streams) give each stream's busy union, the time no stream is busy, and the
    busiest stream's holes longest first, each with the kernels either side."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "prefill_speed.py"
    spec = importlib.util.spec_from_file_location("prefill_speed", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)

    def k(name, ts, dur, stream, cat="kernel"):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts * 1000, "dur": dur * 1000, "args": {"stream": stream}}

    trace = {"traceEvents": [
        k("a", 0, 10, 7), k("b", 5, 10, 7),  # overlapping: 15 ms busy
        k("c", 40, 10, 7), k("d", 60, 40, 7),  # holes of 25 (b→c) and 10 (c→d)
        k("copy", 20, 30, 9, cat="gpu_memcpy"),  # the other stream covers 20..50
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 500},  # host: ignored
    ]}
    use = mod.stream_use(trace)
    assert use["span_ms"] == 100 and use["idle_ms"] == 15  # 15..20 and 50..60
    assert [(r["stream"], r["busy_ms"], r["ops"]) for r in use["streams"]] == [(7, 65, 4), (9, 30, 1)]
    assert [(g["us"], g["after"], g["before"]) for g in use["longest_gaps"]] == [(25000, "b", "c"), (10000, "c", "d")]
    assert mod.stream_use({"traceEvents": []}) == {}
