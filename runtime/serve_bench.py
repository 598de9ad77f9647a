"""``mkc bench-serve``: a serving benchmark in the style of vLLM's ``benchmark_serving``.

Sends ``--num-requests`` streamed ``/v1/completions`` requests of random token ids (so prompt
lengths are exact; ``ignore_eos`` so output lengths are too), all at once or as Poisson arrivals
at ``--request-rate``, at most ``--concurrency`` in flight, to a running server (``--url``) or to
one started in this process from the ``mkc serve`` options. Reports time to first token (TTFT),
time per output token after the first (TPOT), inter-token latency (ITL: every gap between
streamed chunks that carry output) and end-to-end latency (mean, p50, p90, p99), requests/s and
output tok/s, and writes the configuration and every request's record as JSON.

Imports stay light (stdlib only at module level; httpx and numpy when running; FastAPI, uvicorn
and torch only in-process) so building the CLI's parser costs nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import socket
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mkc.runtime.serve_options import add_serve_arguments

if TYPE_CHECKING:
    import httpx
    import numpy as np

DEFAULT_OUTPUT = "build/bench-serve.json"
PERCENTILES = (50, 90, 99)
URL_VOCAB = 256  # prompt ids against --url default to [0, 256): ids every vocabulary holds
STARTUP_TIMEOUT_S = 900  # in-process start-up (weights, kernels) may take minutes on a GPU
READ_TIMEOUT_S = 300  # the longest silence within one response before it counts as failed


class BenchServeError(ValueError):
    """Bad input or an unusable server: one ``mkc: error:`` line and exit status 2."""


# ----------------------------------------------------------------------------------------------
# options


class _OptionalExclusive:
    """Forwards ``add_serve_arguments`` to an argument group, making its required exclusive group
    (--checkpoint | --random-weights) optional: with --url neither is given."""

    def __init__(self, container: Any):
        self._container = container

    def add_mutually_exclusive_group(self, **kwargs: Any) -> Any:
        return self._container.add_mutually_exclusive_group(**{**kwargs, "required": False})

    def __getattr__(self, name: str) -> Any:
        return getattr(self._container, name)


def add_bench_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``mkc bench-serve``: the load, the report, and either --url or the ``mkc serve``
    options of a server run in-process."""
    parser.add_argument("--url", help="base URL of a running server, e.g. http://127.0.0.1:8000 (instead of the "
                                      "in-process server options below)")
    parser.add_argument("--model", help="model id to send (default: the server's first in /v1/models)")
    parser.add_argument("--num-requests", type=int, default=64, help="requests to send (default 64)")
    parser.add_argument("--concurrency", type=int, default=None, help="requests in flight at most (default: no limit)")
    parser.add_argument("--request-rate", type=float, default=math.inf,
                        help="Poisson arrivals per second (default inf: all requests at once)")
    parser.add_argument("--prompt-len", default="128", metavar="L|L1:L2",
                        help="prompt tokens, or a range drawn uniformly (default 128)")
    parser.add_argument("--output-len", default="64", metavar="L|L1:L2",
                        help="output tokens, or a range drawn uniformly (default 64)")
    parser.add_argument("--vocab-size", type=int, default=None,
                        help=f"prompt token ids are drawn from [0, N) (default: the in-process model's vocabulary; "
                             f"{URL_VOCAB} with --url)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="every request's sampling temperature (default 0: greedy); above 0 each request is "
                             "seeded from --seed and its index")
    parser.add_argument("--top-p", type=float, default=1.0, help="every request's nucleus mass (default 1: all)")
    parser.add_argument("-o", "--output", default=DEFAULT_OUTPUT, help=f"JSON report (default {DEFAULT_OUTPUT})")
    group = parser.add_argument_group(
        "in-process server", "start the server in this process with these `mkc serve` options instead of --url "
                             "(--host and --port are unused: it listens on a free port of 127.0.0.1)")
    # one --seed, with or without --url: the load's lengths, prompts and arrivals (and the weights)
    add_serve_arguments(_OptionalExclusive(group), seed_help="seed of the requests' lengths, prompts and arrivals, "
                                                             "and of an in-process server's --random-weights "
                                                             "(default 0)")


def parse_length(option: str, value: str) -> tuple[int, int]:
    """``"L"`` or ``"L1:L2"`` as an inclusive range of positive lengths."""
    parts = value.split(":")
    try:
        lo, hi = (int(parts[0]), int(parts[-1])) if len(parts) <= 2 else (0, -1)
    except ValueError:
        lo, hi = 0, -1
    if len(parts) > 2 or lo < 1 or hi < lo:
        raise BenchServeError(f"{option} {value!r}: expected a positive length L or a range L1:L2 with "
                              f"1 <= L1 <= L2")
    return lo, hi


@dataclass(frozen=True, slots=True)
class LoadConfig:
    """The load, checked: what a benchmark sends and when."""

    num_requests: int
    concurrency: int  # requests in flight at most
    request_rate: float  # Poisson arrivals per second; inf = all at once
    prompt_len: tuple[int, int]  # inclusive range of prompt tokens
    output_len: tuple[int, int]  # inclusive range of output tokens
    seed: int
    temperature: float = 0.0  # each request's sampling: 0 = greedy
    top_p: float = 1.0

    @classmethod
    def from_args(cls, a: argparse.Namespace) -> LoadConfig:
        if a.num_requests < 1:
            raise BenchServeError(f"--num-requests {a.num_requests}: expected at least 1")
        if a.concurrency is not None and a.concurrency < 1:
            raise BenchServeError(f"--concurrency {a.concurrency}: expected at least 1 (or leave it out: no limit)")
        if not a.request_rate > 0:
            raise BenchServeError(f"--request-rate {a.request_rate}: expected a positive rate in requests/s, or inf")
        if not a.temperature >= 0:
            raise BenchServeError(f"--temperature {a.temperature}: expected a number >= 0 (0: greedy)")
        if not 0 < a.top_p <= 1:
            raise BenchServeError(f"--top-p {a.top_p}: expected a number in (0, 1]")
        return cls(num_requests=a.num_requests, concurrency=a.concurrency or a.num_requests,
                   request_rate=a.request_rate, prompt_len=parse_length("--prompt-len", a.prompt_len),
                   output_len=parse_length("--output-len", a.output_len), seed=a.seed,
                   temperature=a.temperature, top_p=a.top_p)


# ----------------------------------------------------------------------------------------------
# the load


@dataclass(frozen=True, slots=True)
class Workload:
    prompts: tuple[tuple[int, ...], ...]  # token ids of each request
    output_lens: tuple[int, ...]  # max_tokens of each request
    arrivals: tuple[float, ...]  # seconds after the start at which each request is due
    probe: tuple[int, ...]  # the probe request's prompt: as long as the first, sharing no prefix with it
    sampling: tuple[dict[str, Any], ...] = ()  # each request's sampling fields; empty: all greedy


def poisson_arrivals(n: int, rate: float, rng: np.random.Generator) -> np.ndarray:
    """Arrival times (s) of ``n`` requests of a Poisson process at ``rate``/s, the first at 0:
    exponential gaps of mean 1/rate. ``rate = inf`` puts every arrival at 0."""
    import numpy as np

    if math.isinf(rate):
        return np.zeros(n)
    gaps = rng.exponential(1.0 / rate, size=n - 1)
    return np.concatenate(([0.0], np.cumsum(gaps)))


def make_workload(load: LoadConfig, vocab_size: int) -> Workload:
    """Lengths, prompts and arrivals from ``load.seed``; each from its own stream, so changing the
    rate does not change the prompts."""
    import numpy as np

    lengths, prompts, arrivals = (np.random.default_rng(s) for s in np.random.SeedSequence(load.seed).spawn(3))
    n = load.num_requests
    prompt_lens = lengths.integers(load.prompt_len[0], load.prompt_len[1] + 1, size=n)
    output_lens = lengths.integers(load.output_len[0], load.output_len[1] + 1, size=n)
    ids = [tuple(int(t) for t in prompts.integers(0, vocab_size, size=int(p))) for p in (*prompt_lens, prompt_lens[0])]
    # a sampled request is seeded from the load's seed and its index, so a run repeats
    sampling = tuple({"temperature": load.temperature, "top_p": load.top_p, "seed": load.seed * 1_000_003 + i}
                     for i in range(n)) if load.temperature > 0 else ()
    return Workload(prompts=tuple(ids[:-1]), output_lens=tuple(int(o) for o in output_lens),
                    arrivals=tuple(float(t) for t in poisson_arrivals(n, load.request_rate, arrivals)),
                    probe=ids[-1], sampling=sampling)


# ----------------------------------------------------------------------------------------------
# one request


@dataclass(slots=True)
class RequestRecord:
    """What one request did; times in seconds."""

    index: int
    prompt_len: int
    output_len: int  # max_tokens asked for
    scheduled_s: float  # due, after the benchmark's start
    start_s: float = 0.0  # sent, after the start (later than due while --concurrency is full)
    ttft_s: float | None = None  # first chunk of output, after start_s
    latency_s: float | None = None  # end of the stream, after start_s
    prompt_tokens: int = 0  # from the usage chunk
    output_tokens: int = 0  # from the usage chunk (chunks with output when the server sends none)
    chunk_times_s: list[float] = field(default_factory=list)  # each chunk of output, after start_s
    # output tokens in each chunk, where chunks carry running usage (vLLM's continuous_usage_stats); else None
    chunk_tokens: list[int] | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first."""
        if not self.ok or self.output_tokens < 2 or self.ttft_s is None or self.latency_s is None:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)

    @property
    def itl_s(self) -> list[float]:
        """Gaps between successive chunks with output."""
        t = self.chunk_times_s
        return [b - a for a, b in itertools.pairwise(t)] if self.ok else []


class StreamParser:
    """Fills a ``RequestRecord`` from the SSE lines of a streamed completion as they arrive."""

    def __init__(self, record: RequestRecord):
        self.record = record
        self.done = False  # saw data: [DONE]
        self._running = 0  # output tokens so far, where chunks report running usage

    def feed(self, line: str, t: float) -> None:
        """One line received ``t`` seconds after the request was sent."""
        if not line.startswith("data:"):
            return  # blank separators, comments, event names
        data = line[5:].strip()
        if data == "[DONE]":
            self.done = True
            return
        try:
            event = json.loads(data)
        except json.JSONDecodeError:
            self.record.error = f"malformed SSE data: {data[:80]!r}"
            return
        if "error" in event:
            err = event["error"]
            self.record.error = str(err.get("message", err) if isinstance(err, dict) else err)
            return
        usage = event.get("usage") or None
        if event.get("choices"):
            self._chunk(usage, t)
        elif usage:  # the final usage chunk (stream_options.include_usage)
            self.record.prompt_tokens = int(usage.get("prompt_tokens", 0))
            self.record.output_tokens = int(usage.get("completion_tokens", 0))

    def _chunk(self, usage: dict[str, Any] | None, t: float) -> None:
        r = self.record
        if usage is not None and "completion_tokens" in usage:
            tokens = int(usage["completion_tokens"]) - self._running
            self._running += tokens
            if tokens <= 0:
                return
            r.chunk_tokens = (r.chunk_tokens or []) + [tokens]
        # else every chunk counts, empty text too (as vLLM's benchmark does): mkc's server sends one
        # per engine output with text, and the finishing one, which brings the last token
        if r.ttft_s is None:
            r.ttft_s = t
        r.chunk_times_s.append(t)

    def finish(self, t: float) -> None:
        """The stream ended ``t`` seconds after it was sent."""
        r = self.record
        r.latency_s = t
        if r.error is None and not self.done:
            r.error = "the stream ended without data: [DONE]"
        elif r.error is None and r.ttft_s is None:
            r.error = "the stream carried no output"
        if r.output_tokens == 0:
            r.output_tokens = sum(r.chunk_tokens) if r.chunk_tokens else len(r.chunk_times_s)


def completion_body(model: str, prompt: Sequence[int], max_tokens: int, sampling: dict[str, Any] | None = None
                    ) -> dict[str, Any]:
    """A streamed /v1/completions request of exactly ``max_tokens`` tokens: greedy, or with
    ``sampling``'s fields (temperature, top_p, seed)."""
    return {"model": model, "prompt": list(prompt), "max_tokens": max_tokens, "temperature": 0.0,
            **(sampling or {}), "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}


async def send_request(client: httpx.AsyncClient, model: str, record: RequestRecord, prompt: Sequence[int],
                       t0: float, sampling: dict[str, Any] | None = None) -> RequestRecord:
    """Send one request and record it; a failure is recorded in ``record.error``, never raised."""
    import httpx

    sent = time.perf_counter()
    record.start_s = sent - t0
    parser = StreamParser(record)
    try:
        async with client.stream("POST", "/v1/completions",
                                 json=completion_body(model, prompt, record.output_len, sampling)) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                record.error = f"HTTP {response.status_code}: {_error_message(body)}"
            else:
                async for line in response.aiter_lines():
                    parser.feed(line, time.perf_counter() - sent)
    except httpx.HTTPError as e:
        record.error = f"{type(e).__name__}: {e}"
    parser.finish(time.perf_counter() - sent)
    return record


def _error_message(body: str) -> str:
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return body[:200]


# ----------------------------------------------------------------------------------------------
# the benchmark


class _Counter:
    """A carriage-return progress counter on stderr, where tqdm is not installed."""

    def __init__(self, total: int):
        self.total, self.n = total, 0
        self.shown = sys.stderr.isatty()

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.shown:
            print(f"\rbench-serve: {self.n}/{self.total} requests", end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.shown:
            print(file=sys.stderr)


def _progress(total: int) -> Any:
    """tqdm on stderr when it is a terminal, else nothing; a plain counter without tqdm."""
    try:
        from tqdm import tqdm
    except ImportError:
        return _Counter(total)
    return tqdm(total=total, unit="req", desc="bench-serve", file=sys.stderr, disable=None)


async def run_load(client: httpx.AsyncClient, model: str, workload: Workload, concurrency: int,
                   progress: Any = None) -> tuple[list[RequestRecord], float]:
    """Send every request of ``workload`` when due, at most ``concurrency`` in flight; returns the
    records in request order and the duration (s) from the first arrival to the last response."""
    gate = asyncio.Semaphore(concurrency)
    t0 = time.perf_counter()

    async def one(i: int) -> RequestRecord:
        record = RequestRecord(index=i, prompt_len=len(workload.prompts[i]), output_len=workload.output_lens[i],
                               scheduled_s=workload.arrivals[i])
        await asyncio.sleep(max(0.0, t0 + record.scheduled_s - time.perf_counter()))
        async with gate:
            await send_request(client, model, record, workload.prompts[i], t0,
                               workload.sampling[i] if workload.sampling else None)
        if progress is not None:
            progress.update(1)
        return record

    records = await asyncio.gather(*(one(i) for i in range(len(workload.prompts))))
    return list(records), time.perf_counter() - t0


def _stats(values: Sequence[float]) -> dict[str, float] | None:
    """Mean and percentiles in milliseconds; None when there are no values."""
    import numpy as np

    if not values:
        return None
    ms = np.asarray(values, dtype=np.float64) * 1e3
    return {"mean": float(ms.mean()), **{f"p{p}": float(np.percentile(ms, p)) for p in PERCENTILES}}


def summarize(records: Sequence[RequestRecord], duration_s: float) -> dict[str, Any]:
    """Counts, throughputs and latency statistics (ms) of the completed requests."""
    ok = [r for r in records if r.ok]
    input_tokens = sum(r.prompt_tokens or r.prompt_len for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    return {
        "completed": len(ok), "failed": len(records) - len(ok), "duration_s": duration_s,
        "input_tokens": input_tokens, "output_tokens": output_tokens,
        "output_chunks": sum(len(r.chunk_times_s) for r in ok),
        "request_throughput": len(ok) / duration_s, "output_throughput": output_tokens / duration_s,
        "total_token_throughput": (input_tokens + output_tokens) / duration_s,
        "ttft_ms": _stats([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot_ms": _stats([t for r in ok if (t := r.tpot_s) is not None]),
        "itl_ms": _stats([g for r in ok for g in r.itl_s]),
        "e2e_ms": _stats([r.latency_s for r in ok if r.latency_s is not None]),
    }


def format_summary(s: dict[str, Any]) -> str:
    """The short table printed after a run."""
    lines = [f"completed       {s['completed']} requests, {s['failed']} failed, in {s['duration_s']:.2f} s",
             (f"throughput      {s['request_throughput']:.2f} req/s, {s['output_throughput']:.1f} output tok/s, "
              f"{s['total_token_throughput']:.1f} total tok/s"),
             f"tokens          {s['input_tokens']} input, {s['output_tokens']} output",
             f"{'(ms)':<15} {'mean':>9} " + " ".join(f"{'p' + str(p):>9}" for p in PERCENTILES)]
    for name, key in (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"), ("E2E latency", "e2e_ms")):
        st = s[key]
        cells = [st["mean"], *(st[f"p{p}"] for p in PERCENTILES)] if st else []
        lines.append(f"{name:<15} " + (" ".join(f"{v:9.2f}" for v in cells) if cells else "-"))
    if s["output_chunks"] < s["output_tokens"]:
        lines.append(f"note: {s['output_chunks']} chunks streamed for {s['output_tokens']} output tokens (a token "
                     f"without text of its own comes with a later chunk): TTFT may be late, ITL is per chunk")
    return "\n".join(lines)


def _json_value(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # inf request rate: JSON has no infinity
    return v if isinstance(v, (str, int, float, bool, type(None), list, tuple)) else str(v)


def write_report(path: Path, args: argparse.Namespace, server: dict[str, Any], summary: dict[str, Any],
                 records: Sequence[RequestRecord]) -> None:
    config = {k: _json_value(v) for k, v in vars(args).items() if k != "fn"}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"config": config, "server": server, "summary": summary,
                                "requests": [asdict(r) for r in records]}, indent=1) + "\n")


# ----------------------------------------------------------------------------------------------
# the server: a URL, or one run in this process


@dataclass(frozen=True, slots=True)
class Target:
    url: str
    model: str
    vocab_size: int  # prompt ids are drawn below this
    context: int | None  # the server's max_model_len where it says


@contextmanager
def in_process_server(args: argparse.Namespace) -> Iterator[Target]:
    """Build the ``mkc serve`` state from ``args`` and serve it with uvicorn in a thread on a free
    port of 127.0.0.1 (real HTTP, so streaming is measured as a client sees it); stopped after."""
    try:
        import uvicorn

        from mkc.runtime.server import build_app, build_state
    except ImportError as e:
        raise BenchServeError(f"the in-process server needs the server dependencies ({e.name} is missing): "
                              f"pip install 'mkc[serve]', or pass --url") from None
    try:
        state = build_state(args)
    except (ValueError, OSError, KeyError) as e:  # SpecError and CheckpointError are ValueErrors
        raise BenchServeError(str(e)) from None
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(build_app(state), log_level="warning", access_log=False,
                                           timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="bench-serve-server", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise BenchServeError("the in-process server did not start (see the log above)")
            time.sleep(0.05)
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        yield Target(url=url, model=args.model or state.model_name, vocab_size=state.vocab_size,
                     context=state.context)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


def url_target(args: argparse.Namespace) -> Target:
    """The running server at ``--url``: its model and context from /v1/models."""
    import httpx

    url = args.url.rstrip("/")
    try:
        r = httpx.get(url + "/v1/models", timeout=10, trust_env=False)
        r.raise_for_status()
        cards = r.json()["data"]
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
        raise BenchServeError(f"--url {args.url}: no OpenAI-style server answers GET /v1/models "
                              f"({type(e).__name__}: {e}); is it running?") from None
    if not cards and not args.model:
        raise BenchServeError(f"--url {args.url}: /v1/models lists no model: pass --model")
    card = next((c for c in cards if c.get("id") == args.model), cards[0] if cards else {})
    return Target(url=url, model=args.model or card["id"], vocab_size=URL_VOCAB, context=card.get("max_model_len"))


@contextmanager
def open_target(args: argparse.Namespace) -> Iterator[Target]:
    """``--url`` or the in-process server: exactly one of them."""
    in_process = bool(args.config or args.checkpoint or args.random_weights)
    if args.url and in_process:
        raise BenchServeError("--url and the in-process options (--config, --checkpoint, --random-weights) "
                              "exclude each other: benchmark a running server or start one, not both")
    if args.url:
        yield url_target(args)
    elif not (args.checkpoint or args.random_weights):
        raise BenchServeError("nothing to benchmark: pass --url of a running server, or --config with "
                              "--random-weights or --checkpoint to start one in this process")
    else:
        with in_process_server(args) as target:
            yield target


# ----------------------------------------------------------------------------------------------
# CLI


async def _bench(target: Target, load: LoadConfig, workload: Workload) -> tuple[list[RequestRecord], float]:
    """A probe request first (a prompt as long as the first, one token: a bad model id or prompt
    fails here, as one error; it also warms the server up), then the load."""
    import httpx

    limits = httpx.Limits(max_connections=load.concurrency + 1, max_keepalive_connections=load.concurrency + 1)
    timeout = httpx.Timeout(10.0, read=READ_TIMEOUT_S)
    async with httpx.AsyncClient(base_url=target.url, limits=limits, timeout=timeout, trust_env=False) as client:
        probe = RequestRecord(index=-1, prompt_len=len(workload.probe), output_len=1, scheduled_s=0.0)
        await send_request(client, target.model, probe, workload.probe, time.perf_counter())
        if not probe.ok:
            raise BenchServeError(f"{target.url}: the probe request failed: {probe.error}")
        progress = _progress(load.num_requests)
        try:
            return await run_load(client, target.model, workload, load.concurrency, progress)
        finally:
            progress.close()


def bench_serve_main(args: argparse.Namespace) -> int:
    """Run ``mkc bench-serve``; returns 0, 1 when some request failed, 2 on bad input, 130 when
    interrupted."""
    try:
        return _main(args)
    except BenchServeError as e:
        print(f"mkc: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # the in-process server stops on the way out; nothing is written
        print("mkc: bench-serve interrupted", file=sys.stderr)
        return 130


def _main(args: argparse.Namespace) -> int:
    load = LoadConfig.from_args(args)
    if args.vocab_size is not None and args.vocab_size < 1:
        raise BenchServeError(f"--vocab-size {args.vocab_size}: expected at least 1")
    with open_target(args) as target:
        need = load.prompt_len[1] + load.output_len[1]
        if target.context is not None and need > target.context:
            raise BenchServeError(f"--prompt-len {args.prompt_len} and --output-len {args.output_len} need up to "
                                  f"{need} positions; the server's context is {target.context}")
        workload = make_workload(load, args.vocab_size or target.vocab_size)
        print(f"bench-serve: {load.num_requests} requests to {target.url} ({target.model}), concurrency "
              f"{load.concurrency}, request rate {load.request_rate} /s", file=sys.stderr)
        records, duration = asyncio.run(_bench(target, load, workload))
    summary = summarize(records, duration)
    print(format_summary(summary))
    for r in records:
        if r.error:
            print(f"request {r.index} failed: {r.error}", file=sys.stderr)
            break
    out = Path(args.output)
    write_report(out, args, {"url": target.url, "model": target.model, "context": target.context}, summary, records)
    print(f"wrote {out}")
    return 1 if summary["failed"] else 0
