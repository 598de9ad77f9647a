"""The serving engine: continuous batching over a decode backend.

Requests join and leave the running batch between decode steps. Each running request holds one
backend *slot* (a batch row with its own KV cache) and a number of KV *pages* (``page_size``
positions each) from a pool; the pool may be smaller than ``max_batch × context``, and when a
running request needs a page that is not there, the youngest running request is preempted: its
slot and pages are freed and it goes back to the front of the queue, to be resumed later by
re-prefilling its prompt plus what it has generated so far. Nothing is ever dropped.

Prompts are prefilled in chunks of ``prefill_chunk`` tokens, between decode steps: while other
streams decode, a step runs at most ``prefill_budget`` decode steps' time of prefill (whole layers,
at least one, each timed before it starts by the slowest of the request's last four, a request's
first by the latest request's) before their next token, so a long prompt never freezes them; with
nobody decoding a step runs one whole chunk.

Full pages of prompts are kept in a prefix cache (when the backend can copy KV out and in), keyed by
the chain of token ids up to the page's end, evicted least recently used whenever a running request
needs the space. A backend that copies KV (the slab layout) keeps each cached page in memory of its
own, so there the cache holds at most ``prefix_cache_pages`` copies, the least recently used
making way for a new prompt's.

Threading: ``submit`` and ``abort`` may be called from any thread; everything else runs on the
engine's own thread (``start``) or in the caller's thread through ``step`` (tests). Outputs go to
each request's ``sink`` from the engine thread, in order, ending with one whose ``finish_reason``
is set.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from mkc.runtime.metrics import Metrics
from mkc.runtime.sampling import SamplingParams, make_generator, sample, sample_batch
from mkc.runtime.tokenizer import IncrementalDetokenizer, Tokenizer

log = logging.getLogger("mkc.engine")


class Backend(Protocol):
    """What the engine needs from a decode backend (CPU executor, CUDA megakernel).

    A slot is one batch row with its own KV cache of ``context`` positions. ``prefill`` and
    ``decode`` are only called from the engine thread, never concurrently.
    """

    max_batch: int  # slots
    context: int  # KV positions per slot
    vocab_size: int  # logits width

    def prefill(self, slot: int, token_ids: Sequence[int], start: int = 0) -> torch.Tensor:
        """Write the K/V of ``token_ids`` at positions ``start, start+1, ...`` of ``slot`` (positions
        below ``start`` already hold this sequence's cache) and return the logits [V] of the last."""
        ...

    def decode(self, slots: Sequence[int], tokens: Sequence[int], positions: Sequence[int]) -> torch.Tensor:
        """One step for the given slots: token ``tokens[i]`` at ``positions[i]`` in ``slots[i]``;
        returns logits [n, V]. Slots not listed must be left as they are."""
        ...

    def free(self, slot: int) -> None:
        """The slot's sequence is gone (its cache may be reused from position 0)."""
        ...


class LayeredBackend(Backend, Protocol):
    """Optional: a prefill that can stop between layers (the engine interleaves it with decode)."""

    def prefill_layers(self, slot: int, token_ids: Sequence[int], start: int = 0, *,
                       logits: bool = True) -> Generator[None, None, torch.Tensor | None]:
        """``prefill`` as a generator: it yields once a layer's work is done (finished on the
        device, so the engine can time it) and returns the logits [V] of the last token, or None
        when ``logits`` is False. Bad arguments raise at the call, before any work."""
        ...


class KVCopyBackend(Backend, Protocol):
    """Optional: a backend that can copy KV positions out of a slot and back (prefix cache)."""

    def read_kv_pages(self, slot: int, start: int, page_size: int, n: int) -> list[Any]:
        """Opaque copies of ``n`` pages of the slot's KV (all layers) from position ``start``, each
        in memory of its own (one page's eviction frees it)."""
        ...

    def write_kv_pages(self, slot: int, start: int, pages: Sequence[Any]) -> None:
        """Put ``read_kv_pages`` copies back, one after another from position ``start``."""
        ...


@dataclass(slots=True)
class Output:
    """One delta of a request's output, delivered to its sink."""

    request_id: str
    text: str  # new text since the previous output
    token_ids: list[int]  # new token ids since the previous output
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error", set on the last output
    prompt_tokens: int = 0
    completion_tokens: int = 0  # tokens generated so far
    error: str | None = None  # message when finish_reason == "error"


Sink = Callable[[Output], None]


@dataclass(eq=False, slots=True)
class _Request:
    id: str
    prompt: list[int]
    params: SamplingParams
    sink: Sink
    gen: torch.Generator
    detok: IncrementalDetokenizer
    arrival: float
    output: list[int] = field(default_factory=list)  # generated ids
    slot: int = -1  # backend slot while running
    kv_len: int = 0  # positions of the slot's cache that hold this request
    pages: int = 0  # KV pages held
    admitted: int = 0  # admission order (preemption takes the youngest)
    held: str = ""  # text held back: it may be the start of a stop string
    steps: Generator[None, None, torch.Tensor | None] | None = None  # the prefill chunk in flight
    chunk_end: int = 0  # position after the chunk in flight
    layer_seconds: deque[float] = field(default_factory=lambda: deque(maxlen=4))  # its latest prefill layers
    last_token_at: float | None = None
    finished: bool = False
    preemptions: int = 0

    @property
    def ids(self) -> list[int]:
        return self.prompt + self.output


def _pages(positions: int, page_size: int) -> int:
    return -(-positions // page_size)


class PrefixCache:
    """Full KV pages keyed by a hash chain of the token ids from position 0 to the page's end. A
    page is a KV copy, or with a backend that shares pages a page id it keeps alive (``on_evict``
    lets it go)."""

    def __init__(self, page_size: int, on_evict: Callable[[Any], None] | None = None):
        self.page_size, self.on_evict = page_size, on_evict
        self.pages: OrderedDict[tuple, Any] = OrderedDict()  # key → kv copy or page id, oldest first

    def keys(self, ids: Sequence[int], n_pages: int) -> list[tuple]:
        keys, prev = [], None
        for i in range(n_pages):
            prev = (hash(prev), tuple(ids[i * self.page_size:(i + 1) * self.page_size]))
            keys.append(prev)
        return keys

    def match(self, ids: Sequence[int], max_pages: int) -> list[Any]:
        """KV copies of the longest cached run of leading pages (at most ``max_pages``)."""
        out = []
        for k in self.keys(ids, max_pages):
            kv = self.pages.get(k)
            if kv is None:
                break
            self.pages.move_to_end(k)
            out.append(kv)
        return out

    def evict(self) -> bool:
        if not self.pages:
            return False
        _, page = self.pages.popitem(last=False)
        if self.on_evict is not None:
            self.on_evict(page)
        return True

    def __len__(self) -> int:
        return len(self.pages)


class Engine:
    """Continuous batching over ``backend``; see the module docstring for the policy."""

    def __init__(self, backend: Backend, tokenizer: Tokenizer, *, page_size: int = 16,
                 kv_pages: int | None = None, prefix_cache: bool = True, metrics: Metrics | None = None,
                 prefill_chunk: int = 8192, prefill_budget: float = 1.5, prefix_cache_pages: int | None = None):
        if prefill_chunk < 1 or prefill_budget <= 0:
            raise ValueError(f"prefill_chunk = {prefill_chunk}, prefill_budget = {prefill_budget}: expected a "
                             f"chunk of at least one token and a positive budget")
        self.backend, self.tok, self.page_size = backend, tokenizer, page_size
        self.prefill_chunk = prefill_chunk  # prompt tokens per backend prefill call
        self.prefill_budget = prefill_budget  # prefill time between decode steps, in decode steps
        full = backend.max_batch * _pages(backend.context, page_size)
        self.kv_pages = full if kv_pages is None else kv_pages
        if self.kv_pages < _pages(backend.context, page_size):
            raise ValueError(f"kv_pages = {self.kv_pages}: expected at least one full context "
                             f"({_pages(backend.context, page_size)} pages of {page_size}), or a request "
                             f"could never run")
        # a paged backend shares cached pages by reference (retain / attach / drop); others copy KV
        self._share = bool(getattr(backend, "shares_pages", False))
        copies = hasattr(backend, "read_kv_pages") and hasattr(backend, "write_kv_pages")
        self.cache = (PrefixCache(page_size, backend.drop_page if self._share else None)  # type: ignore[attr-defined]
                      if prefix_cache and (self._share or copies and prefix_cache_pages != 0) else None)
        # KV copies take memory beside the pool: a bound of their own (shared pages are the pool's)
        self._copy_limit = None if self._share else prefix_cache_pages
        self.metrics = metrics
        self._lock = threading.Condition()
        self._incoming: deque[_Request] = deque()
        self._aborts: set[str] = set()
        self._waiting: deque[_Request] = deque()
        self._running: list[_Request] = []  # decoding
        self._prefilling: deque[_Request] = deque()  # holding a slot, prompt not yet all prefilled
        self._step_seconds: float | None = None  # a decode step's time, smoothed
        self._layer_estimate = 0.0  # the latest request's prefill layer estimate, for one with none yet
        self._free_slots = list(range(backend.max_batch))
        self._pages_used = 0
        self._admissions = itertools.count()
        self._oom_without_progress = False  # out of GPU memory since the last token emitted
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.steps = 0  # decode steps run (tests, logs)

    # -- public, any thread ----------------------------------------------------------------------
    def submit(self, prompt: Sequence[int], params: SamplingParams, sink: Sink,
               request_id: str | None = None) -> str:
        """Queue a request; raises ValueError if it can never run (the server checks first)."""
        params.check()
        if not prompt:
            raise ValueError("prompt is empty: expected at least one token")
        if len(prompt) >= self.backend.context:
            raise ValueError(f"prompt has {len(prompt)} tokens: expected fewer than the context "
                             f"({self.backend.context})")
        rid = request_id or f"req-{next(self._ids)}"
        req = _Request(id=rid, prompt=list(prompt), params=params, sink=sink, gen=make_generator(params.seed),
                       detok=IncrementalDetokenizer(self.tok), arrival=time.monotonic())
        with self._lock:
            self._incoming.append(req)
            self._lock.notify()
        return rid

    def abort(self, request_id: str) -> None:
        """Stop a request (a client went away): its slot and pages are freed before the next step."""
        with self._lock:
            self._aborts.add(request_id)
            self._lock.notify()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="mkc-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        with self._lock:
            self._stopping = True
            self._lock.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        """The engine thread is running (``start`` was called and it has not died)."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def num_running(self) -> int:
        """Requests holding a slot: decoding, or with their prompt being prefilled."""
        return len(self._running) + len(self._prefilling)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting) + len(self._incoming)

    @property
    def pages_used(self) -> int:
        return self._pages_used

    def has_work(self) -> bool:
        with self._lock:
            return bool(self._incoming or self._waiting or self._running or self._prefilling or self._aborts)

    # -- the loop --------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._lock:
                while not (self._stopping or self._incoming or self._waiting or self._running or self._prefilling
                           or self._aborts):
                    self._lock.wait()
                if self._stopping:
                    break
            try:
                self.step()
            except Exception as e:  # a backend failure ends every request in flight, not the server
                log.exception("engine step failed")
                self._fail_all(f"{type(e).__name__}: {e}")
        self._fail_all("server shutting down", reason="abort")

    def step(self) -> None:
        """Admit what fits, run prefill work (one chunk, or the budget while others decode), then
        one decode step over the running batch. Out of GPU memory: ``_out_of_memory``."""
        with self._lock:
            self._waiting.extend(self._incoming)
            self._incoming.clear()
            aborts, self._aborts = self._aborts, set()
        if aborts:
            self._apply_aborts(aborts)
        try:
            self._prefill_some()
            if self._running:
                self._decode()
        except torch.cuda.OutOfMemoryError as e:
            self._out_of_memory(e)
        self._report_state()

    # -- admission and prefill -------------------------------------------------------------------
    def _admit(self) -> bool:
        """Give the oldest waiting request a slot and its prompt's pages, if they are free; True if
        it was admitted. One request is prefilled at a time, so a prompt admitted after another
        finds that one's pages in the prefix cache."""
        if not (self._waiting and self._free_slots):
            return False
        req = self._waiting[0]
        ids = self._prompt_ids(req)
        # leave a page of headroom per request holding a slot, or the next decode step would
        # preempt the request just admitted (and waste its prefill)
        if not self._reserve(_pages(len(ids), self.page_size), headroom=self.num_running):
            return False
        self._waiting.popleft()
        req.pages = _pages(len(ids), self.page_size)
        req.slot = self._free_slots.pop(0)
        req.admitted = next(self._admissions)
        req.kv_len = self._load_prefix(req, ids)
        self._prefilling.append(req)
        return True

    @staticmethod
    def _prompt_ids(req: _Request) -> list[int]:
        """What a request prefills: its prompt; a resumed one everything but its last token, which
        the next decode step feeds."""
        return req.ids[:-1] if req.output else req.prompt

    def _prefill_some(self) -> None:
        """Admit and prefill prompts, oldest first, up to ``prefill_chunk`` tokens in all: to the
        end of the chunk when nobody decodes, else whole layers while the next one, timed as the
        slowest of the last four, ends within ``prefill_budget`` decode steps' time (at least one
        layer); a chunk cut short goes on at the next step."""
        deadline = None
        if self._running and self._step_seconds is not None:
            deadline = time.monotonic() + self.prefill_budget * self._step_seconds

        def out_of_budget(req: _Request | None) -> bool:  # would its next layer end past it?
            if not self._running:
                return False
            return deadline is None or time.monotonic() + self._next_layer_seconds(req) > deadline

        tokens = self.prefill_chunk
        while tokens > 0 and (self._prefilling or self._admit()):
            req = self._prefilling[0]
            ids = self._prompt_ids(req)
            if req.steps is None:
                req.chunk_end = min(len(ids), req.kv_len + tokens)
                req.steps = self._prefill_steps(req.slot, ids[req.kv_len:req.chunk_end], req.kv_len,
                                                logits=req.chunk_end == len(ids) and not req.output)
            tokens -= req.chunk_end - req.kv_len
            t0 = t = time.monotonic()
            while True:
                try:
                    next(req.steps)
                except StopIteration as done:
                    if self.metrics:
                        self.metrics.on_prefill(req.chunk_end - req.kv_len, time.monotonic() - t0)
                    req.steps, req.kv_len = None, req.chunk_end
                    if req.kv_len == len(ids):
                        self._prefilled(req, ids, done.value)
                    break
                req.layer_seconds.append(time.monotonic() - t)
                self._layer_estimate = max(req.layer_seconds)
                t = time.monotonic()
                if out_of_budget(req):
                    if self.metrics:
                        self.metrics.on_prefill(0, time.monotonic() - t0)
                    return
            if out_of_budget(self._prefilling[0] if self._prefilling else None):
                return

    def _next_layer_seconds(self, req: _Request | None) -> float:
        """A prefill layer's time before it starts: the slowest of the request's last four; for a
        request with none yet (or the next to be admitted), the latest request's estimate, so its
        first layer cannot start past the budget; 0 before any layer was ever timed."""
        if req is not None and req.layer_seconds:
            return max(req.layer_seconds)
        return self._layer_estimate

    def _prefill_steps(self, slot: int, ids: list[int], start: int,
                       logits: bool) -> Generator[None, None, torch.Tensor | None]:
        layered = getattr(self.backend, "prefill_layers", None)
        if layered is not None:
            return layered(slot, ids, start, logits=logits)
        return self._whole_prefill(slot, ids, start)

    def _whole_prefill(self, slot: int, ids: list[int], start: int) -> Generator[None, None, torch.Tensor]:
        """A backend with no layered prefill: the chunk in one call, as a generator that ends at
        its first ``next``."""
        return self.backend.prefill(slot, ids, start)
        yield  # unreachable: makes this function a generator

    def _prefilled(self, req: _Request, ids: list[int], logits: torch.Tensor | None) -> None:
        """The prompt is all in the cache: the request decodes from now on."""
        self._prefilling.remove(req)
        self._running.append(req)
        self._store_prefix(req, ids)
        if not req.output:  # a new request's first token; a resumed one has it already
            assert logits is not None
            self._emit_token(req, sample(logits, req.params, req.gen))

    def _reserve(self, pages: int, headroom: int = 0) -> bool:
        """Take ``pages`` (evicting prefix-cache pages, never preempting) if ``headroom`` more would
        still be free; True on success."""
        while self.kv_pages - self._pages_used - self._cached_pages() < pages + headroom:
            if self.cache is None or not self.cache.evict():
                return False
        self._pages_used += pages
        return True

    def _cached_pages(self) -> int:
        return len(self.cache) if self.cache is not None else 0

    def _load_prefix(self, req: _Request, ids: list[int]) -> int:
        if self.cache is None:
            return 0
        # keep at least one token to prefill: its logits are the first sample
        kvs = self.cache.match(ids, (len(ids) - 1) // self.page_size)
        if self._share:
            for i, kv in enumerate(kvs):
                self.backend.attach_page(req.slot, i, kv)  # type: ignore[attr-defined]
        elif kvs:
            self.backend.write_kv_pages(req.slot, 0, kvs)  # type: ignore[attr-defined]
        n = len(kvs) * self.page_size
        if n and self.metrics:
            self.metrics.on_prefix_hit(n)
        return n

    def _store_prefix(self, req: _Request, ids: list[int]) -> None:
        if self.cache is None:
            return
        full = len(req.prompt) // self.page_size
        keys = self.cache.keys(ids, min(full, len(ids) // self.page_size))
        for key in keys:  # the prompt's cached pages become the most recently used
            if key in self.cache.pages:
                self.cache.pages.move_to_end(key)
        if self._copy_limit is not None:  # make way for its other pages, older prompts' first
            new = sum(key not in self.cache.pages for key in keys)
            room = min(new, self._copy_limit - (len(keys) - new))
            while len(self.cache) + room > self._copy_limit and self.cache.evict():
                pass
        store = []  # the pages to cache, in order
        for i, key in enumerate(keys):
            if key in self.cache.pages:
                continue
            # the cache only takes space nobody holds, and copies no more than their bound
            if (self.kv_pages - self._pages_used - len(self.cache) - len(store) < 1
                    or self._copy_limit is not None and len(self.cache) + len(store) >= self._copy_limit):
                break
            store.append(i)
        if self._share:
            for i in store:
                self.cache.pages[keys[i]] = self.backend.retain_page(req.slot, i)  # type: ignore[attr-defined]
        elif store:  # one read for the span (a page cached between two new ones is read again)
            lo = store[0]
            copies = self.backend.read_kv_pages(req.slot, lo * self.page_size, self.page_size,  # type: ignore[attr-defined]
                                                store[-1] + 1 - lo)
            for i in store:
                self.cache.pages[keys[i]] = copies[i - lo]

    # -- decode ----------------------------------------------------------------------------------
    def _decode(self) -> None:
        # every running request writes one more position: find it a page, preempting if needed
        for req in sorted(self._running, key=lambda r: r.admitted):
            if req.finished or req.slot < 0:
                continue
            need = _pages(req.kv_len + 1, self.page_size) - req.pages
            while need > 0 and not self._reserve(need):
                holders = [r for r in self._running if not r.finished] + list(self._prefilling)
                victim = max(holders, key=lambda r: r.admitted)
                self._preempt(victim)
                if victim is req:
                    break
            if not req.finished and req.slot >= 0:
                req.pages += max(need, 0)
        batch = [r for r in self._running if r.slot >= 0 and not r.finished]
        if not batch:
            return
        t0 = time.monotonic()
        logits = self.backend.decode([r.slot for r in batch], [r.ids[-1] for r in batch],
                                     [r.kv_len for r in batch])
        seconds = time.monotonic() - t0
        self._step_seconds = seconds if self._step_seconds is None else 0.8 * self._step_seconds + 0.2 * seconds
        self.steps += 1
        if self.metrics:
            self.metrics.on_step(seconds)
        # every row sampled where the logits live, one copy of the tokens to the host
        tokens = sample_batch(logits, [r.params for r in batch], [r.gen for r in batch])
        for req, token in zip(batch, tokens):
            req.kv_len += 1
            self._emit_token(req, token)

    def _preempt(self, req: _Request, why: str = "KV space") -> None:
        log.info("preempting %s (%d tokens) for %s", req.id, len(req.ids), why)
        self._release(req)
        req.preemptions += 1
        self._waiting.appendleft(req)
        if self.metrics:
            self.metrics.on_preempt()

    def _release(self, req: _Request) -> None:
        if req in self._running:
            self._running.remove(req)
        if req in self._prefilling:
            self._prefilling.remove(req)
        if req.steps is not None:  # a chunk in flight: its positions are dropped with the slot
            req.steps.close()
            req.steps = None
        if req.slot >= 0:
            self.backend.free(req.slot)
            self._free_slots.append(req.slot)
            self._free_slots.sort()
        self._pages_used -= req.pages
        req.slot, req.pages, req.kv_len = -1, 0, 0

    # -- output ----------------------------------------------------------------------------------
    def _emit_token(self, req: _Request, token: int) -> None:
        now = time.monotonic()
        self._oom_without_progress = False
        req.output.append(token)
        if self.metrics:
            if req.last_token_at is None:
                self.metrics.on_first_token(now - req.arrival)
            self.metrics.on_token(None if req.last_token_at is None else now - req.last_token_at)
        req.last_token_at = now
        p = req.params
        finish = None
        if not p.ignore_eos and (token in self.tok.eos_ids or token in p.stop_token_ids):
            finish = "stop"
            text = req.detok.flush()
        else:
            text = req.detok.push(token)
            if len(req.output) >= p.max_tokens or len(req.ids) > self.backend.context:
                finish = "length"
                text += req.detok.flush()
        text, stopped = self._apply_stop(req, text, final=finish is not None)
        if stopped:
            finish = "stop"
        self._send(req, Output(req.id, text, [token], finish, len(req.prompt), len(req.output)))
        if finish:
            self._finish(req, finish)

    def _apply_stop(self, req: _Request, text: str, final: bool) -> tuple[str, bool]:
        """Cut ``text`` at a stop string, and hold back a tail that may start one."""
        stops = req.params.stop
        if not stops:
            return text, False
        buf = req.held + text
        hits = [i for i in (buf.find(s) for s in stops) if i >= 0]
        if hits:
            req.held = ""
            return buf[:min(hits)], True
        if final:
            req.held = ""
            return buf, False
        keep = 0
        for s in stops:
            for n in range(min(len(s) - 1, len(buf)), keep, -1):
                if buf.endswith(s[:n]):
                    keep = n
                    break
        req.held = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep], False

    def _send(self, req: _Request, out: Output) -> None:
        try:
            req.sink(out)
        except Exception:  # a broken sink must not take the engine down
            log.exception("sink of %s failed; aborting it", req.id)
            req.finished = True
            self.abort(req.id)

    def _finish(self, req: _Request, reason: str) -> None:
        req.finished = True
        self._release(req)
        if self.metrics:
            self.metrics.on_finish(reason, len(req.prompt))

    def _apply_aborts(self, ids: set[str]) -> None:
        for q in (self._waiting, self._prefilling, self._running):
            for req in [r for r in q if r.id in ids]:
                if q is self._waiting:
                    self._waiting.remove(req)
                self._send(req, Output(req.id, "", [], "abort", len(req.prompt), len(req.output)))
                self._finish(req, "abort")

    def _fail_all(self, message: str, reason: str = "error") -> None:
        with self._lock:
            self._waiting.extend(self._incoming)
            self._incoming.clear()
        for req in list(self._running) + list(self._prefilling) + list(self._waiting):
            self._fail(req, message, reason)
        self._waiting.clear()

    def _fail(self, req: _Request, message: str, reason: str = "error") -> None:
        """End ``req`` with an output that carries ``message`` as its error."""
        self._send(req, Output(req.id, "", [], reason, len(req.prompt), len(req.output), error=message))
        self._finish(req, reason)

    def _out_of_memory(self, e: Exception) -> None:
        """The GPU ran out of memory in a step: the prefix cache is dropped and the requests in
        flight go back to the queue (resumed by re-prefilling, as after a preemption); a second
        time with no token emitted in between, those requests fail with one line instead."""
        what = str(e).split(". ")[0]  # torch's first sentence: "CUDA out of memory"
        in_flight = sorted(list(self._running) + list(self._prefilling), key=lambda r: r.admitted, reverse=True)
        if self._oom_without_progress:
            log.error("out of GPU memory again with no token in between: failing %d requests", len(in_flight))
            for req in in_flight:
                self._fail(req, f"out of GPU memory ({what}); lower --max-batch or --context")
        else:
            log.warning("out of GPU memory (%s): dropping the prefix cache, requeueing %d requests", what,
                        len(in_flight))
            for req in in_flight:  # youngest first, so the oldest ends at the front of the queue
                self._preempt(req, "GPU memory")
        self._oom_without_progress = True
        while self.cache is not None and self.cache.evict():
            pass
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _report_state(self) -> None:
        if self.metrics:
            self.metrics.on_state(running=self.num_running, waiting=self.num_waiting,
                                  max_batch=self.backend.max_batch, pages_used=self._pages_used,
                                  pages_cached=self._cached_pages(), pages_total=self.kv_pages)
