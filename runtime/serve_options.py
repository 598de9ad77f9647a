"""Options of ``mkc serve``, apart from the server itself so that building the CLI's parser does
not import FastAPI, uvicorn or torch (``mkc compile`` starts faster)."""

from __future__ import annotations

import argparse


def _sizes(v: str) -> list[int]:
    try:
        return [int(x) for x in v.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{v!r}: expected batch sizes separated by commas, e.g. 1,2,4") from None


def add_serve_arguments(parser: argparse.ArgumentParser, seed_help: str = "seed of --random-weights (default 0)") -> None:
    """Options of ``mkc serve`` (``seed_help``: what --seed seeds, for a command that adds to it)."""
    parser.add_argument("--config", help="model YAML, HF config.json, checkpoint folder or .gguf file "
                                         "(default: the --checkpoint)")
    w = parser.add_mutually_exclusive_group(required=True)
    w.add_argument("--checkpoint", help="Hugging Face checkpoint folder (safetensors; tokenizer files if any) or .gguf file")
    w.add_argument("--random-weights", action="store_true", help="random weights (demo; byte-level tokenizer)")
    parser.add_argument("--seed", "--weights-seed", dest="seed", type=int, default=0,
                        help=seed_help)
    parser.add_argument("--backend", choices=("auto", "cuda", "cpu"), default="auto",
                        help="cuda: the megakernel; cpu: the CPU executor (runs anywhere); auto: cuda when a "
                             "GPU and the CUDA backend are present")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    parser.add_argument("--max-batch", type=int, default=8, help="sequences decoded together (1-8; default 8)")
    parser.add_argument("--step-batches", type=_sizes, default=None,
                        help="batch sizes with a decode kernel of their own, e.g. 1,2,4 (default: the powers of "
                             "two below --max-batch); a step runs the smallest that holds the running streams")
    parser.add_argument("--context", type=int, default=1024, help="KV positions per sequence (default 1024)")
    parser.add_argument("--page-size", type=int, default=16, help="KV page size in positions (default 16)")
    parser.add_argument("--kv-pages", type=int, default=None,
                        help="KV pages in the pool (default: max-batch x context / page-size); fewer pages "
                             "make the engine preempt and requeue requests")
    parser.add_argument("--no-prefix-cache", action="store_true", help="do not cache full prompt pages")
    parser.add_argument("--prefill-chunk", type=int, default=8192,
                        help="prompt tokens prefilled per engine step (default 8192); a longer prompt takes "
                             "several steps, with the running streams' decode steps between them")
    parser.add_argument("--prefill-budget", type=float, default=1.5,
                        help="while other streams decode: prefill time between two of their steps, in decode "
                             "steps (default 1.5, so their inter-token latency stays under 3 steps with room "
                             "for host work; whole layers, at least one)")
    parser.add_argument("--kv-layout", choices=("slab", "paged"), default="slab",
                        help="slab: one KV slab of the whole context per batch slot; paged: a pool of --kv-pages "
                             "pages of --page-size positions that slots take as they grow (the kernel reads them "
                             "through a page table)")
    parser.add_argument("--weights", choices=("bf16", "fp8", "fp8-block"), default="bf16",
                        help="how the attention, MLP, expert and LM-head matrices are stored: bf16, fp8 (e4m3, a "
                             "scale per output row) or fp8-block (a scale per 128 x 128 block); quantised at load "
                             "from the checkpoint or random weights (default bf16)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                        help="weights/activations (default: float32 on cpu, bfloat16 on cuda)")
    parser.add_argument("--num-sms", type=int, default=None,
                        help="persistent CTAs of the schedule (default: 8 on cpu, every SM on cuda)")
    parser.add_argument("--cpu-threads", type=int, default=None,
                        help="torch intra-op threads (default: 1 with the cpu backend, whose per-tile ops "
                             "are too small to split; the torch default otherwise)")
    parser.add_argument("--served-model-name", default=None, help="model id clients send (default: the spec name)")
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"),
                        help="server and engine log level (default info: start-up progress, preemptions)")
