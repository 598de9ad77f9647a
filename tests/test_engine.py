"""Engine policy without HTTP and without a model: continuous batching, preemption when KV runs out,
abort frees the slot, stop strings, the prefix cache.

The fake backend's "KV cache" holds the token ids themselves, and its logits are a function of the
whole cached sequence, so a wrong or missing cache position changes the output (or raises).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import pytest
import torch
from conftest import record_preemptions, run_engine

from mkc.runtime.engine import Engine, Output
from mkc.runtime.sampling import SamplingParams, make_generator, sample, sample_batch
from mkc.runtime.tokenizer import ByteTokenizer, IncrementalDetokenizer

V = 300


class FakeBackend:
    def __init__(self, max_batch: int = 4, context: int = 128, copy_kv: bool = True):
        self.max_batch, self.context, self.vocab_size = max_batch, context, V
        self.cache = torch.full((max_batch, context), -1, dtype=torch.long)
        self.prefills: list[tuple[int, int, int]] = []  # (slot, start, n)
        self.page_reads = 0  # read_kv_pages calls
        if copy_kv:  # without them the backend has no KV copies at all (hasattr is False)
            self.read_kv_pages, self.write_kv_pages = self._read_kv_pages, self._write_kv_pages

    def _logits(self, slot: int, pos: int) -> torch.Tensor:
        seq = self.cache[slot, :pos + 1]
        assert (seq >= 0).all(), f"slot {slot} has a hole in its cache before position {pos}: {seq.tolist()}"
        # next token: a byte 'a'..'z' picked by a hash of the whole sequence
        h = int((seq * torch.arange(1, pos + 2)).sum()) * 2654435761 % 2**32
        out = torch.zeros(V)
        out[97 + h % 26] = 5.0
        return out

    def prefill(self, slot, token_ids, start=0):
        assert (self.cache[slot, :start] >= 0).all()
        self.prefills.append((slot, start, len(token_ids)))
        self.cache[slot, start:start + len(token_ids)] = torch.tensor(token_ids)
        return self._logits(slot, start + len(token_ids) - 1)

    def decode(self, slots, tokens, positions):
        for s, t, p in zip(slots, tokens, positions):
            self.cache[s, p] = t
        return torch.stack([self._logits(s, p) for s, p in zip(slots, positions)])

    def free(self, slot):
        self.cache[slot] = -1

    def _read_kv_pages(self, slot, start, page_size, n):
        self.page_reads += 1
        return [self.cache[slot, p:p + page_size].clone() for p in range(start, start + n * page_size, page_size)]

    def _write_kv_pages(self, slot, start, pages):
        kv = torch.cat(list(pages))
        self.cache[slot, start:start + len(kv)] = kv


def run_all(engine: Engine, prompts: list[str], params: SamplingParams, max_steps: int = 2000) -> list[list[Output]]:
    return run_engine(engine, [engine.tok.encode(p) for p in prompts], params, max_steps)


def text_of(outs: list[Output]) -> str:
    return "".join(o.text for o in outs)


PROMPTS = [f"prompt number {i} " * (1 + i % 3) for i in range(10)]


def test_batching_matches_one_at_a_time():
    greedy = SamplingParams(max_tokens=20, temperature=0)
    tok = ByteTokenizer(V)
    together = run_all(Engine(FakeBackend(), tok), PROMPTS, greedy)
    for i, p in enumerate(PROMPTS):
        alone = run_all(Engine(FakeBackend(), tok), [p], greedy)[0]
        assert text_of(together[i]) == text_of(alone)
        assert together[i][-1].finish_reason == "length" and together[i][-1].completion_tokens == 20
        assert sum(o.finish_reason is not None for o in together[i]) == 1


@pytest.mark.parametrize("chunk", [8192, 7], ids=["whole", "chunked"])
def test_preemption_requeues_and_resumes(chunk):
    greedy = SamplingParams(max_tokens=40, temperature=0)
    tok = ByteTokenizer(V)
    ample = run_all(Engine(FakeBackend(context=128), tok), PROMPTS, greedy)
    # 8 pages of 16 = one full context: at most a couple of these sequences fit at once; a chunk of
    # 7 tokens makes a resumed request's prefill (prompt and output) take several steps
    tight = Engine(FakeBackend(context=128), tok, page_size=16, kv_pages=8, prefill_chunk=chunk)
    preempted = record_preemptions(tight)
    squeezed = run_all(tight, PROMPTS, greedy)
    assert preempted, "the pool was large enough: the test does not exercise preemption"
    for a, b in zip(ample, squeezed):
        assert text_of(a) == text_of(b)
        assert b[-1].finish_reason == "length"
    assert tight.pages_used == 0 and sorted(tight._free_slots) == list(range(4))


def test_abort_frees_slot():
    tok = ByteTokenizer(V)
    eng = Engine(FakeBackend(max_batch=2), tok)
    got: dict[str, list[Output]] = {"a": [], "b": [], "c": []}
    params = SamplingParams(max_tokens=30, temperature=0)
    for k, outs in got.items():
        eng.submit(tok.encode(k * 5), params, outs.append, request_id=k)
    for _ in range(3):  # prompts are admitted one prefill at a time
        eng.step()
    assert eng.num_running == 2 and eng.num_waiting == 1  # c waits for a slot
    eng.abort("a")
    eng.step()
    assert got["a"][-1].finish_reason == "abort"
    holding = {r.id for r in eng._running} | {r.id for r in eng._prefilling}  # c may still be prefilling
    assert holding == {"b", "c"} and eng.num_running == 2
    while eng.has_work():
        eng.step()
    assert got["c"][-1].finish_reason == "length" and eng.pages_used == 0


def test_stop_strings_cut_and_hold_back():
    tok = ByteTokenizer(V)
    greedy = SamplingParams(max_tokens=30, temperature=0)
    full = text_of(run_all(Engine(FakeBackend(), tok), ["hello"], greedy)[0])
    stop = full[10:13]
    outs = run_all(Engine(FakeBackend(), tok), ["hello"], SamplingParams(max_tokens=30, temperature=0,
                                                                          stop=(stop, "never")))[0]
    assert text_of(outs) == full[:full.index(stop)]
    assert outs[-1].finish_reason == "stop"


def test_prefix_cache_reuses_pages():
    tok = ByteTokenizer(V)
    be = FakeBackend(context=128)
    eng = Engine(be, tok, page_size=16)
    shared = "a shared system prompt, long enough for two pages of sixteen"
    greedy = SamplingParams(max_tokens=8, temperature=0)
    first = run_all(eng, [shared + " one"], greedy)[0]
    second = run_all(eng, [shared + " one"], greedy)[0]
    assert text_of(first) == text_of(second)
    assert be.prefills[-1][1] == 48  # three full pages loaded from the cache
    assert be.page_reads == 1  # the first prompt's pages copied in one read
    # a backend that cannot copy its KV cache: no prefix cache, every prompt prefilled from its start
    nocopy = FakeBackend(context=128, copy_kv=False)
    assert not hasattr(nocopy, "read_kv_pages") and not hasattr(nocopy, "write_kv_pages")
    eng = Engine(nocopy, tok, page_size=16)
    assert eng.cache is None
    for _ in range(2):
        assert text_of(run_all(eng, [shared + " one"], greedy)[0]) == text_of(first)
    assert [start for _, start, _ in nocopy.prefills] == [0, 0]


def test_prefix_cache_copies_stay_within_their_bound():
    """A backend that copies KV keeps at most ``prefix_cache_pages`` copies, least recently used
    going first: a prompt of three full pages after another of three leaves the newer one's
    pages (with a bound of 4, the older one's first page is evicted), which still serve a repeat;
    the older prompt, its first page gone, is prefilled from its start."""
    tok = ByteTokenizer(V)
    be = FakeBackend(context=128)
    eng = Engine(be, tok, page_size=16, prefix_cache_pages=4)
    greedy = SamplingParams(max_tokens=4, temperature=0)
    one, two = "x" * 50 + " one", "y" * 50 + " two"  # 54 tokens: three full pages each
    first = [text_of(run_all(eng, [p], greedy)[0]) for p in (one, two)]
    assert len(eng.cache) == 4
    assert text_of(run_all(eng, [two], greedy)[0]) == first[1]
    assert be.prefills[-1][1] == 48  # three pages from the cache
    assert text_of(run_all(eng, [one], greedy)[0]) == first[0]
    assert be.prefills[-1][1] == 0
    assert len(eng.cache) <= 4
    # no copies at all: no prefix cache
    assert Engine(FakeBackend(context=128), tok, page_size=16, prefix_cache_pages=0).cache is None


class OutOfMemoryBackend(FakeBackend):
    """Raises CUDA's out-of-memory error at the prefills and decode steps numbered in ``fail``
    (counted together from 0), as a GPU backend does when it runs out."""

    def __init__(self, fail: set[int], **kw):
        super().__init__(**kw)
        self.fail, self.calls = fail, 0

    def _maybe_fail(self):
        self.calls += 1
        if self.calls - 1 in self.fail:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 768.00 MiB. GPU 0 has ...")

    def prefill(self, slot, token_ids, start=0):
        self._maybe_fail()
        return super().prefill(slot, token_ids, start)

    def decode(self, slots, tokens, positions):
        self._maybe_fail()
        return super().decode(slots, tokens, positions)


def test_out_of_memory_requeues_the_requests_in_flight_and_drops_the_prefix_cache():
    """A step that runs out of GPU memory (a prefill, later a decode step) loses nothing: the
    requests in flight are resumed by re-prefilling and give the tokens they give without it;
    the prefix cache is emptied."""
    greedy = SamplingParams(max_tokens=12, temperature=0)
    tok = ByteTokenizer(V)
    prompts = PROMPTS[:4]
    want = [text_of(o) for o in run_all(Engine(FakeBackend(), tok), prompts, greedy)]
    be = OutOfMemoryBackend({2, 9}, context=128)
    eng = Engine(be, tok, page_size=4)
    preempted = record_preemptions(eng)
    cached_after: list[int] = []  # the prefix cache's size after each out-of-memory
    handle = eng._out_of_memory
    eng._out_of_memory = lambda e: (handle(e), cached_after.append(len(eng.cache)))  # type: ignore[method-assign]
    outs = run_all(eng, prompts, greedy)
    assert [text_of(o) for o in outs] == want
    assert len(cached_after) == 2 and not any(cached_after)
    assert len(eng.cache) > 0  # filled again since
    assert all(o[-1].finish_reason == "length" and o[-1].error is None for o in outs)
    assert len(preempted) >= 2  # each out-of-memory requeued what was in flight


def test_out_of_memory_twice_with_no_token_between_fails_the_requests_in_flight():
    """Out of memory again before any token came out: the requests in flight end with one line
    naming the GPU memory; the waiting ones and later requests still run."""
    greedy = SamplingParams(max_tokens=5, temperature=0)
    tok = ByteTokenizer(V)
    be = OutOfMemoryBackend({0, 1}, max_batch=1, context=128)
    outs = run_all(Engine(be, tok), ["first", "second"], greedy)
    first, second = outs
    assert first[-1].finish_reason == "error" and "\n" not in first[-1].error
    assert first[-1].error.startswith("out of GPU memory (CUDA out of memory)")
    alone = run_all(Engine(FakeBackend(max_batch=1), tok), ["second"], greedy)[0]
    assert text_of(second) == text_of(alone) and second[-1].finish_reason == "length"


def test_sampling_seeded_and_filtered():
    logits = torch.randn(V, generator=torch.Generator().manual_seed(0))
    p = SamplingParams(max_tokens=1, temperature=0.8, top_p=0.9, top_k=20, seed=3)
    a = [sample(logits, p, make_generator(3)) for _ in range(3)]
    assert len(set(a)) == 1  # same seed, same draw
    top20 = set(torch.topk(logits, 20).indices.tolist())
    g = make_generator(1)
    assert all(sample(logits, p, g) in top20 for _ in range(200))
    assert sample(logits, SamplingParams(max_tokens=1, temperature=0), g) == int(logits.argmax())


@pytest.mark.parametrize("params", [SamplingParams(1, temperature=0.7), SamplingParams(1, temperature=1.3, top_k=4),
                                    SamplingParams(1, temperature=1.0, top_p=0.8),
                                    SamplingParams(1, temperature=0.9, top_k=5, top_p=0.9)],
                         ids=["temperature", "top_k", "top_p", "all"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_sampled_tokens_follow_the_distribution(params, device):
    """6,000 draws from 8 logits (on the host, or where a GPU's logits are) land on each token as
    often as its probability after temperature, top_k and top_p, computed here in float64 (within 5 standard errors; a draw shifted to the next
    token or a filter off by one misses by far more), and never on a token the filters drop."""
    logits = torch.tensor([2.0, 1.5, 1.4, 0.3, 0.0, -0.5, -1.0, 1.0])
    x = logits.double() / params.temperature
    keep = torch.ones(8, dtype=torch.bool)
    if params.top_k:
        keep &= x >= torch.topk(x, params.top_k).values[-1]
    if params.top_p < 1:
        p = torch.softmax(x.masked_fill(~keep, float("-inf")), -1)
        order = torch.argsort(p, descending=True)
        before = torch.cumsum(p[order], 0) - p[order]
        keep[order[before >= params.top_p]] = False
    want = torch.softmax(x.masked_fill(~keep, float("-inf")), -1)
    n, g = 6000, make_generator(11)
    rows = logits[None].expand(n, 8).to(device)
    got = torch.bincount(torch.tensor(sample_batch(rows, [params] * n, [g] * n)), minlength=8)
    freq = got.double() / n
    assert bool((got[~keep] == 0).all()), f"drew dropped tokens: {got.tolist()} (kept {keep.tolist()})"
    bound = 5 * (want * (1 - want) / n).sqrt() + 1e-3
    assert bool(((freq - want).abs() <= bound).all()), f"frequencies {freq.tolist()}, expected {want.tolist()}"


def test_a_rows_draws_do_not_depend_on_the_batch():
    """Each row of a batch (greedy, temperature, top_k, top_p beside each other) draws the tokens
    it draws alone, from its own generator: a seeded request repeats whatever else runs."""
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(4, 300, generator=g)
    params = [SamplingParams(1, temperature=0), SamplingParams(1, temperature=0.8),
              SamplingParams(1, temperature=1.0, top_k=7), SamplingParams(1, temperature=0.6, top_p=0.85)]
    together = [make_generator(20 + b) for b in range(4)]
    alone = [make_generator(20 + b) for b in range(4)]
    for _ in range(30):
        batch = sample_batch(logits, params, together)
        assert batch == [sample(logits[b], params[b], alone[b]) for b in range(4)]
    assert batch[0] == int(logits[0].argmax())


def test_sample_batch_reads_nothing_back_before_the_tokens():
    """On CUDA each host list made a tensor is a blocking copy, and each value read back
    (``bool``, ``int``, ``.item``) waits for the device. A mixed batch (greedy, top_k, top_p) makes
    one tensor of host values, the rows' parameters packed, and reads back no value: only the
    tokens' ``tolist``, which does not dispatch ``_local_scalar_dense``."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func.__name__)
            return func(*args, **(kwargs or {}))

    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(5))
    params = [SamplingParams(1, temperature=0), SamplingParams(1, temperature=0.8, top_k=7),
              SamplingParams(1, temperature=1.0, top_k=3), SamplingParams(1, temperature=0.6, top_p=0.85)]
    with Ops() as seen:
        sample_batch(logits, params, [make_generator(b) for b in range(4)])
    assert seen.ops.count("lift_fresh.default") == 1, f"host values made tensors: {seen.ops}"
    assert "_local_scalar_dense.default" not in seen.ops, f"values read back: {seen.ops}"


def test_detokenizer_never_splits_utf8():
    tok = ByteTokenizer(V)
    d = IncrementalDetokenizer(tok)
    text = "héllo €uro 😀!"
    out = "".join(d.push(t) for t in tok.encode(text)) + d.flush()
    assert out == text


def test_backend_failure_ends_requests_not_engine():
    tok = ByteTokenizer(V)
    be = FakeBackend()
    eng = Engine(be, tok)
    got: list[Output] = []
    real_decode = be.decode
    be.decode = lambda *a: (_ for _ in ()).throw(RuntimeError("device lost"))  # type: ignore[method-assign]
    eng.start()
    try:
        eng.submit(tok.encode("boom"), SamplingParams(max_tokens=5, temperature=0), got.append)
        deadline = time.monotonic() + 10
        while not (got and got[-1].finish_reason) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert got[-1].finish_reason == "error" and "device lost" in (got[-1].error or "")
        be.decode = real_decode  # type: ignore[method-assign]
        again: list[Output] = []
        eng.submit(tok.encode("fine"), SamplingParams(max_tokens=3, temperature=0), again.append)
        while not (again and again[-1].finish_reason) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert again[-1].finish_reason == "length" and eng.pages_used == 0
    finally:
        eng.stop()


class LayeredBackend(FakeBackend):
    """FakeBackend whose prefill runs LAYERS layers, each advancing a fake clock by PREFILL_LAYER
    seconds (a decode step takes DECODE), and which logs every event in order."""

    LAYERS, PREFILL_LAYER, DECODE = 6, 0.004, 0.010

    def __init__(self, clock: list[float], layer_times: Sequence[float] = (), head_seconds: float = 0.0, **kw):
        super().__init__(**kw)
        self.clock, self.events = clock, []  # events: ("layer", slot, start, n, layer) | ("decode", slots)
        self.layer_times = layer_times  # seconds of each layer, when they differ
        self.head_seconds = head_seconds  # a chunk's logits after its last layer (final norm, LM head)

    def prefill_layers(self, slot, token_ids, start=0, *, logits=True):
        if start + len(token_ids) > self.context:
            raise ValueError("past the context")
        return self._layers(slot, list(token_ids), start, logits)

    def _layers(self, slot, ids, start, logits):
        for layer in range(self.LAYERS):
            self.clock[0] += self.layer_times[layer] if self.layer_times else self.PREFILL_LAYER
            self.events.append(("layer", slot, start, len(ids), layer))
            yield
        out = FakeBackend.prefill(self, slot, ids, start)  # the cache is written when the chunk ends
        if logits:
            self.clock[0] += self.head_seconds
        return out if logits else None

    def decode(self, slots, tokens, positions):
        self.clock[0] += self.DECODE
        self.events.append(("decode", tuple(slots)))
        return super().decode(slots, tokens, positions)


def test_long_prompt_is_chunked_between_decode_steps(monkeypatch):
    """A long prompt arriving while a stream decodes: it is prefilled in chunks of prefill_chunk
    tokens, a chunk's layers cut into slices of at most prefill_budget decode steps (here 2 x 10
    ms = 20 ms: five 4 ms layers), and the running stream decodes between slices; its tokens and
    the long prompt's are those of the two run alone."""
    clock = [0.0]
    monkeypatch.setattr("mkc.runtime.engine.time.monotonic", lambda: clock[0])
    tok = ByteTokenizer(V)
    greedy = SamplingParams(max_tokens=30, temperature=0)
    be = LayeredBackend(clock, context=128)
    eng = Engine(be, tok, prefill_chunk=32, prefill_budget=2.0)
    short, long = tok.encode("hi"), tok.encode("a long prompt " * 6)  # 84 tokens: 3 chunks
    got: dict[str, list[Output]] = {"short": [], "long": []}
    eng.submit(short, greedy, got["short"].append, request_id="short")
    for _ in range(3):
        eng.step()
    eng.submit(long, greedy, got["long"].append, request_id="long")
    while eng.has_work():
        eng.step()
    # the long prompt's chunks: positions 0, 32, 64 of 32, 32, 20 tokens, each layer once
    chunks = [(e[2], e[3]) for e in be.events if e[0] == "layer" and e[1] == 1]
    assert sorted(set(chunks)) == [(0, 32), (32, 32), (64, 20)] and len(chunks) == 3 * be.LAYERS
    # between two decode steps of the short stream, at most 20 ms of prefill: 5 layers
    first_long = next(i for i, e in enumerate(be.events) if e[0] == "layer" and e[1] == 1)
    last_long = max(i for i, e in enumerate(be.events) if e[0] == "layer" and e[1] == 1)
    run = 0
    for e in be.events[first_long:last_long + 1]:
        run = run + 1 if e[0] == "layer" else 0
        assert run <= 5, "a slice of prefill longer than the budget froze the running stream"
    decodes = [e for e in be.events[first_long:last_long] if e[0] == "decode"]
    assert len(decodes) >= 3 and all(0 in e[1] for e in decodes), "the short stream did not decode meanwhile"
    for name, prompt in (("short", short), ("long", long)):
        alone = run_engine(Engine(FakeBackend(context=128), tok), [prompt], greedy)[0]
        assert text_of(got[name]) == text_of(alone)


@pytest.mark.parametrize("layer_times", [(0.003, 0.003, 0.009, 0.003, 0.003, 0.009), (0.025,) * 6],
                         ids=["uneven-layers", "layers-over-budget"])
def test_prefill_slice_ends_within_the_budget(monkeypatch, layer_times):
    """Between two decode steps of a running stream, the prefill runs only the layers that end
    within prefill_budget decode steps (here 2 x 10 ms), each timed as the slowest of the request's
    last four: uneven layers never carry a slice past 20 ms (without the estimate, 3 + 3 + 9 + 9
    would); a layer longer than the whole budget still runs, one a step, so the prompt gets on."""
    clock = [0.0]
    monkeypatch.setattr("mkc.runtime.engine.time.monotonic", lambda: clock[0])
    tok = ByteTokenizer(V)
    greedy = SamplingParams(max_tokens=40, temperature=0)
    be = LayeredBackend(clock, layer_times, context=128)
    eng = Engine(be, tok, prefill_chunk=32, prefill_budget=2.0)
    got: list[Output] = []
    eng.submit(tok.encode("hi"), greedy, got.append, request_id="short")
    for _ in range(3):
        eng.step()
    eng.submit(tok.encode("a long prompt " * 6), greedy, lambda o: None, request_id="long")
    while eng.has_work():
        eng.step()
    slices, run = [], []  # the long prompt's layers between two decode steps, in seconds
    for e in be.events[3:]:
        if e[0] == "layer" and e[1] == 1:
            run.append(layer_times[e[4]])
        elif e[0] == "decode" and run:
            slices.append(run)
            run = []
    assert len(slices) >= 3 and sum(map(len, slices)) == 3 * be.LAYERS
    for run in slices:
        assert sum(run) <= 0.020 + 1e-9 or len(run) == 1, f"a prefill slice of {run} s passed the 20 ms budget"
    assert text_of(got) == text_of(run_engine(Engine(FakeBackend(context=128), tok), [tok.encode("hi")], greedy)[0])


def test_a_new_prompts_first_layer_is_timed_by_the_last_known_layer(monkeypatch):
    """Two short prompts arrive while a stream decodes, in one chunk's tokens (budget 2 x 10 ms,
    4 ms layers). The first's last two layers and its logits (10 ms) end 18 ms into a step: the
    second's first layer, with no history of its own, is timed by the latest estimate of any
    request (4 ms: to 22 ms, past the budget), so it waits for the next step. Timed as 0 s, it ran
    to 22 ms."""
    clock = [0.0]
    monkeypatch.setattr("mkc.runtime.engine.time.monotonic", lambda: clock[0])
    tok = ByteTokenizer(V)
    greedy = SamplingParams(max_tokens=20, temperature=0)
    be = LayeredBackend(clock, head_seconds=0.010, context=128)
    eng = Engine(be, tok, prefill_chunk=32, prefill_budget=2.0)
    eng.submit(tok.encode("hi"), greedy, lambda o: None, request_id="short")
    for _ in range(3):
        eng.step()
    for name in ("first", "second"):  # 8 tokens each: both in one chunk of 32
        eng.submit(tok.encode(f"{name:>8}"), greedy, lambda o: None, request_id=name)
    slices = []  # each step's prefill: from its start to its decode step
    decode = be.decode
    monkeypatch.setattr(be, "decode", lambda *a: (slices.append(clock[0] - start), decode(*a))[1])
    while eng.has_work():
        start = clock[0]
        eng.step()
    assert sum(e[0] == "layer" and e[1] != 0 for e in be.events) == 2 * be.LAYERS  # slot 0: the stream
    assert max(slices) <= 0.020 + 1e-9, f"prefill slices {[round(x, 3) for x in slices]} s: one past 20 ms"


def test_metrics_count_prefilled_tokens():
    from mkc.runtime.metrics import Metrics

    tok = ByteTokenizer(V)
    metrics = Metrics()
    eng = Engine(FakeBackend(), tok, prefill_chunk=7, prefix_cache=False, metrics=metrics)
    run_all(eng, PROMPTS[:4], SamplingParams(max_tokens=3, temperature=0))
    assert metrics.prefilled_tokens._value.get() == sum(len(tok.encode(p)) for p in PROMPTS[:4])
    assert metrics.prefill_time._value.get() > 0
