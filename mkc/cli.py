"""The ``mkc`` command line: compile, check, import-hf, generate, serve, bench.

User errors (a bad YAML key, an impossible shape, an unsafe schedule) print one line naming what
was wrong and what was expected, and exit non-zero; they never print a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from mkc.ir.spec import SpecError

EXIT_UNSAFE = 1  # mkc check: the schedule is unsafe
EXIT_USAGE = 2  # bad input (config, options, files)
DEFAULT_MAX_CONTEXT = 8192  # mkc generate: the longest context it picks by itself (--context for more)


class UsageError(Exception):
    """A user mistake outside the spec (a missing file, a bad option)."""


def _batch(v: str) -> int:
    try:
        n = int(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{v!r}: expected an integer from 1 to 8") from None
    if not 1 <= n <= 8:
        raise argparse.ArgumentTypeError(f"{n}: expected an integer from 1 to 8")
    return n


def _at_least(lo: int, expected: str):
    """An argparse type: an integer >= lo, else the error says ``expected``."""
    def parse(v: str) -> int:
        try:
            n = int(v)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{v!r}: expected {expected}") from None
        if n < lo:
            raise argparse.ArgumentTypeError(f"{n}: expected {expected}")
        return n
    return parse


_positive = _at_least(1, "a positive integer")
_page_size = _at_least(0, "0 (one KV slab per sequence) or a positive page size")
_sms_count = _at_least(0, "'auto' or a number of SMs (0: none set apart)")


def _attention_sms(v: str) -> int | None:
    return None if v == "auto" else _sms_count(v)


def _ids(v: str) -> list[int]:
    try:
        ids = [int(x) for x in v.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{v!r}: expected comma-separated token ids, e.g. 1,2,3") from None
    if not ids or any(i < 0 for i in ids):
        raise argparse.ArgumentTypeError(f"{v!r}: expected one or more non-negative token ids")
    return ids


def _batches(v: str) -> list[int]:
    return [_batch(x) for x in v.split(",") if x.strip()]


def _weight_formats(v: str) -> list[str]:
    from mkc.ir.fp8 import WEIGHT_FORMATS

    got = [x.strip() for x in v.split(",") if x.strip()]
    bad = [x for x in got if x not in WEIGHT_FORMATS]
    if not got or bad or len(set(got)) != len(got):
        raise argparse.ArgumentTypeError(f"{v!r}: expected distinct formats out of {', '.join(WEIGHT_FORMATS)}, "
                                         f"comma-separated, e.g. bf16,fp8")
    return got


WEIGHTS_HELP = ("how the attention, MLP, expert and LM-head matrices are stored: bf16, fp8 (e4m3 with a "
                "float32 scale per output row) or fp8-block (a scale per 128 x 128 block, as most FP8 "
                "checkpoints); embeddings, norms and routers stay bf16 (default bf16; docs/design.md)")


def _contexts(v: str) -> list[int]:
    return [_positive(x) for x in v.split(",") if x.strip()]


# -- commands -------------------------------------------------------------------------------------


def _kernel_line(kernel_json: Path, schedule) -> str:
    """One summary line for the compiled kernel: its name, resources and weight layout (and, when
    the GEMV weights stay row-major, why tile order was not possible), whether the expert-up
    tiles read tagged router logits (CodegenOptions.tagged_logits), and the L2 warm-up and
    evict-first streams (CodegenOptions.l2_warm, weights_evict_first) where they are on."""
    import json

    from mkc.codegen.render import tile_order_problem
    from mkc.codegen.taskwords import l2_warm_hints, routing_logits

    k = json.loads(kernel_json.read_text())
    layout = "weights in tile order"
    if not k["config"]["weights_tiled"]:
        layout = f"weights row-major ({tile_order_problem(schedule) or 'asked for'})"
    if k["config"].get("tagged_logits") and routing_logits(schedule):
        layout += ", tagged router logits"
    if k["config"].get("l2_warm", "off") != "off" and l2_warm_hints(schedule, k["config"]["l2_warm"]):
        layout += f", L2 warm-up {k['config']['l2_warm']}"
    if k["config"].get("weights_evict_first"):
        layout += ", evict-first streams"
    line = (f"kernel          {k['name']}: {k['regs']} registers, {k['dynamic_smem']} + {k['static_smem']} B "
            f"shared memory, {layout}")
    by_op = k.get("sass_by_op")
    if by_op:  # the code size: the kernel does not fit the instruction cache (docs/kernel.md)
        top = ", ".join(f"{op} {n:,}" for op, n in list(by_op.items())[:4])
        line += f"\ncode            {sum(by_op.values()):,} SASS instructions; the largest: {top}"
    return line


def cmd_compile(a: argparse.Namespace) -> int:
    from mkc.compiler import OutputError, compile_to_folder
    from mkc.schedule import visualize

    out = Path(a.output or f"build/{Path(a.config).stem}-b{a.batch}-c{a.context}")
    t0 = time.perf_counter()
    lowering = {} if a.residual_in_o_proj == "auto" else {"residual_in_o_proj": a.residual_in_o_proj == "on"}
    if a.global_attention_sms is not None:
        lowering["global_attention_sms"] = a.global_attention_sms
    if a.weights != "bf16":
        lowering["weights"] = a.weights
    try:
        res = compile_to_folder(a.config, out, batch=a.batch, context=a.context, num_sms=a.num_sms,
                                page_size=a.page_size, attention_sms=a.attention_sms, kernel=not a.no_kernel,
                                gpu=a.gpu, **lowering)
    except OutputError as e:
        raise UsageError(str(e)) from None
    wall = time.perf_counter() - t0
    print(visualize.format_summary(visualize.summary(res.schedule, res.spec)))
    if "kernel.json" in res.files:
        print(_kernel_line(res.files["kernel.json"], res.schedule))
    stages = ", ".join(f"{k} {v:.2f}s" for k, v in res.timings.items())
    print(f"compiled in {wall:.2f}s ({stages})")
    print(f"wrote {out}/: " + ", ".join(sorted(res.files)))
    return 0


def cmd_check(a: argparse.Namespace) -> int:
    from mkc.schedule.schedule import Schedule
    from mkc.schedule.validator import validate

    p = Path(a.schedule)
    if not p.is_file():
        what = "a folder" if p.is_dir() else "no such file"
        raise UsageError(f"{p}: {what}: expected a schedule.json written by mkc compile")
    try:
        sc = Schedule.load(p)
    except ValueError as e:  # not JSON, not UTF-8, or not a schedule (Schedule.from_json)
        raise UsageError(f"{p}: not a valid mkc schedule: {e}") from None
    except OSError as e:
        raise UsageError(f"{p}: cannot read it ({e.strerror or e})") from None
    problems = validate(sc)
    if not problems:
        print(f"{p}: safe ({len(sc.tasks)} tasks on {len(sc.queues)} SMs, {len(sc.counters)} counters)")
        return 0
    print(f"{p}: UNSAFE, {len(problems)} problem(s):")
    for pr in problems[: a.max_problems]:
        print(f"  {pr.kind}: {pr.message}")
    if len(problems) > a.max_problems:
        print(f"  ... and {len(problems) - a.max_problems} more")
    return EXIT_UNSAFE


def cmd_import_hf(a: argparse.Namespace) -> int:
    import yaml

    from mkc.ir.spec import load_spec

    src = Path(a.config)
    spec = load_spec(src)
    if a.name:
        import dataclasses

        spec = dataclasses.replace(spec, name=a.name)
    text = yaml.safe_dump(spec.to_yaml_dict(), sort_keys=False, default_flow_style=None)
    header = f"# imported by `mkc import-hf` from {src}\n"
    if a.output:
        try:
            Path(a.output).write_text(header + text)
        except OSError as e:
            raise UsageError(f"-o {a.output}: cannot write it ({e.strerror or e}): expected a YAML file path") from None
        print(f"wrote {a.output}")
    else:
        sys.stdout.write(header + text)
    return 0


def cmd_generate(a: argparse.Namespace) -> int:
    from mkc.ir.spec import load_spec

    spec = load_spec(a.config)
    bad = [i for i in a.prompt_ids if i >= spec.vocab_size]
    if bad:
        raise UsageError(f"--prompt-ids: {bad[0]} is outside the vocabulary: expected ids < {spec.vocab_size}")
    context = _generate_context(a, _max_positions(a.config, a.checkpoint))
    import torch  # after the checks: importing torch takes seconds

    from mkc.runtime.generate import Progress, greedy_generate
    from mkc.runtime.weights import load_checkpoint, random_weights

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[a.dtype]
    if a.checkpoint:
        weights = load_checkpoint(a.checkpoint, spec, dtype)
    else:
        weights = random_weights(spec, a.seed, dtype)
    progress = Progress(len(a.prompt_ids) + a.max_new_tokens - 1, context=context)
    try:
        tokens = greedy_generate(spec, weights, a.prompt_ids, a.max_new_tokens, dtype=dtype, backend=a.backend,
                                 context=context, weights_format=a.weights, progress=progress)
    except ValueError as e:
        raise UsageError(str(e)) from None
    finally:
        progress.close()
    if a.json:
        print(json.dumps({"tokens": tokens}))
    else:
        print(" ".join(map(str, tokens)))
    return 0


def _generate_context(a: argparse.Namespace, model_max: int | None) -> int:
    """The context mkc generate compiles for: --context, else the positions the request needs
    rounded up to a power of two (at least 64). A request that does not fit it, or that passes
    the model's own limit, or that asks more than DEFAULT_MAX_CONTEXT without --context, is
    refused before anything is loaded."""
    from mkc.runtime.generate import context_bucket

    need = len(a.prompt_ids) + a.max_new_tokens  # positions, the last generated token's included
    what = f"the prompt ({len(a.prompt_ids)} tokens) and --max-new-tokens {a.max_new_tokens} need {need} positions"
    if model_max is not None and need > model_max:
        raise UsageError(f"{what}: the model allows {model_max} (max_position_embeddings): expected at most "
                         f"{max(model_max - len(a.prompt_ids), 0)} new tokens")
    if a.context is not None:
        if need > a.context:
            raise UsageError(f"{what}, more than --context {a.context}: expected at most "
                             f"{max(a.context - len(a.prompt_ids), 0)} new tokens, or a larger --context")
        return a.context
    if need > DEFAULT_MAX_CONTEXT:
        raise UsageError(f"{what}, more than {DEFAULT_MAX_CONTEXT}, the longest context picked by default: "
                         f"pass --context {context_bucket(need)} to compile for it (slow on the cpu backend, which "
                         f"reports its tokens/s)")
    return context_bucket(need)


def _max_positions(config: str, checkpoint: str | None) -> int | None:
    """The model's max_position_embeddings where its Hugging Face config or GGUF metadata gives
    one (a YAML spec carries none)."""
    for src in (checkpoint, config):
        if src is None:
            continue
        p = Path(src)
        cfg = p / "config.json" if p.is_dir() else p
        try:
            if cfg.suffix == ".json":
                d = json.loads(cfg.read_text())
            elif cfg.suffix == ".gguf":
                from mkc.ir.gguf_config import hf_config_from_gguf

                d = hf_config_from_gguf(cfg)
            else:
                continue
        except (OSError, ValueError):
            continue
        n = d.get("max_position_embeddings") if isinstance(d, dict) else None
        if isinstance(n, int) and not isinstance(n, bool) and n > 0:
            return n
    return None


def cmd_bench(a: argparse.Namespace) -> int:
    from mkc.runtime.bench import bench_main

    return bench_main(a)


# -- parser ---------------------------------------------------------------------------------------


def _model_arguments(p: argparse.ArgumentParser, *, seed: int) -> None:
    """--config and where the weights come from (a checkpoint, or random with a seed)."""
    p.add_argument("--config", required=True, help="model YAML, checkpoint folder, or .gguf file")
    w = p.add_mutually_exclusive_group(required=True)
    w.add_argument("--checkpoint", help="safetensors folder (transformers tensor names) or .gguf file")
    w.add_argument("--random-weights", action="store_true", help="random weights (see --seed)")
    p.add_argument("--seed", type=int, default=seed, help=f"seed of the random weights (default {seed})")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mkc",
                                description="Compile an LLM decode step into one persistent GPU kernel.")
    p.add_argument("--version", action="version", version=f"mkc {_version()}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    c = sub.add_parser("compile", help="lower, schedule, validate and write the artifacts of a model")
    _compile_arguments(c)
    c.set_defaults(fn=cmd_compile)

    k = sub.add_parser("check", help="re-validate a schedule.json: exit 0 if safe, 1 if not",
                       description="Prove again that a schedule cannot deadlock or race (the checks mkc "
                                   "compile runs). Exit 0: safe; 1: unsafe, with the tasks, counters and "
                                   "buffers involved; 2: not a schedule.")
    _check_arguments(k)
    k.set_defaults(fn=cmd_check)

    h = sub.add_parser("import-hf", help="write the YAML equivalent of a Hugging Face config.json or a .gguf file's metadata")
    _import_hf_arguments(h)
    h.set_defaults(fn=cmd_import_hf)

    g = sub.add_parser("generate", help="greedy decoding through the compiled schedule",
                       description="Greedy-decode after a prompt of token ids, every token (the prompt's "
                                   "too) through the compiled schedule; prints the generated ids. A run "
                                   "longer than a few seconds reports its progress in tokens/s on stderr.")
    _generate_arguments(g)
    g.set_defaults(fn=cmd_generate)

    b = sub.add_parser("bench",
                       help="decode step time on a GPU: megakernel beside a CUDA-graph PyTorch baseline")
    _bench_arguments(b)
    b.set_defaults(fn=cmd_bench)

    # serve, bench-serve and quantize: their options are declared beside their code
    from mkc.runtime.serve_options import add_serve_arguments

    s = sub.add_parser("serve", help="OpenAI-compatible server with continuous batching")
    add_serve_arguments(s)
    s.set_defaults(fn=cmd_serve)

    from mkc.runtime.serve_bench import add_bench_serve_arguments

    v = sub.add_parser("bench-serve",
                       help="serving benchmark of a running server (--url) or one started in-process: TTFT, "
                            "time per output token, inter-token latency, tok/s")
    add_bench_serve_arguments(v)
    v.set_defaults(fn=cmd_bench_serve)

    from mkc.runtime.quantize import add_quantize_arguments

    q = sub.add_parser("quantize", help="write an FP8 (e4m3) copy of a bf16/fp32 checkpoint folder",
                       description="Store the attention, MLP, expert and untied LM-head matrices of a "
                                   "Hugging Face checkpoint as float8_e4m3fn with float32 scales, in "
                                   "transformers' FineGrainedFP8 layout (--scheme block) or "
                                   "compressed-tensors float-quantized (--scheme channel); mkc --checkpoint, "
                                   "transformers and vLLM read it.")
    add_quantize_arguments(q)
    q.set_defaults(fn=cmd_quantize)
    return p


def _compile_arguments(c: argparse.ArgumentParser) -> None:
    """mkc compile: the model, the point it is compiled for (batch, context, SMs, KV pages), the
    lowering choices the tuner may also make, and the GPU it is simulated on."""
    c.add_argument("config", help="model YAML, a Hugging Face config.json, a checkpoint folder, or a "
                                  "llama.cpp .gguf file")
    c.add_argument("-o", "--output", help="output folder (default build/<config>-b<batch>-c<context>)")
    c.add_argument("--batch", type=_batch, default=1, help="sequences decoded together, 1-8 (default 1)")
    c.add_argument("--context", type=_positive, default=8192,
                   help="context bucket in positions (default 8192)")
    c.add_argument("--num-sms", type=_positive, default=132,
                   help="SMs = persistent CTAs (default 132, H100/H200)")
    c.add_argument("--page-size", type=_page_size, default=0,
                   help="KV cache page in positions, read through a page table (default 0: one contiguous "
                        "slab per sequence; see docs/kernel.md)")
    c.add_argument("--attention-sms", type=_attention_sms, default=None, metavar="auto|N",
                   help="SMs set apart for the attention splits of a parallel block, the MLP tiles filling "
                        "the rest (default auto: the count mkc bench --tune measured fastest at this point, "
                        "else the one the cost model predicts fastest; 0: every op fills all SMs). A count "
                        "given here takes none of a tuning entry's other measured choices (raise, spread, "
                        "layer end, splits, tile rows): they were measured together")
    c.add_argument("--global-attention-sms", type=_attention_sms, default=None, metavar="auto|N",
                   help="SMs' worth of attention splits in the layers of global attention, which at a long "
                        "context attend more keys than the sliding windows (default auto: what mkc bench "
                        "--tune measured fastest at this point, else 0; 0: as many as the other layers; at "
                        "most 4 times --num-sms)")
    c.add_argument("--residual-in-o-proj", choices=["auto", "on", "off"], default="auto",
                   help="on: the O-projection tiles add the residual stream and the MLP's output and end "
                        "the layer, no residual tiles; off: residual tiles sum them (default auto: what mkc "
                        "bench --tune measured faster at this point, else for a parallel block off and for a "
                        "sequential block what its probe's simulated step prefers; docs/tiling.md)")
    from mkc.schedule.cost import GPUS

    c.add_argument("--gpu", choices=sorted(GPUS), default="h200",
                   help="the GPU whose read bandwidth the predicted step and its speed-of-light fraction are "
                        "simulated at (default h200; " + ", ".join(f"{g}: {ceil.read_bw / 1e12:.2f} TB/s"
                                                                  for g, ceil in GPUS.items())
                        + "). The schedule and the kernel are the same for each: the H200's cost model and "
                          "tuning table place it")
    from mkc.ir.fp8 import WEIGHT_FORMATS

    c.add_argument("--weights", choices=WEIGHT_FORMATS, default="bf16", help=WEIGHTS_HELP)
    c.add_argument("--no-kernel", action="store_true", help="skip rendering and compiling the CUDA kernel")


def _check_arguments(k: argparse.ArgumentParser) -> None:
    """mkc check: the schedule.json to prove safe again."""
    k.add_argument("schedule", help="the schedule.json written by mkc compile (possibly edited)")
    k.add_argument("--max-problems", type=_positive, default=20, help="problems to list at most (default 20)")


def _import_hf_arguments(h: argparse.ArgumentParser) -> None:
    """mkc import-hf: the Hugging Face config to translate and where the YAML goes."""
    h.add_argument("config", help="config.json, checkpoint folder, or .gguf file")
    h.add_argument("-o", "--output", help="YAML file to write (default: stdout)")
    h.add_argument("--name", help="model name to use in the YAML")


def _generate_arguments(g: argparse.ArgumentParser) -> None:
    """mkc generate: the model, the prompt, how many tokens, and which backend runs the schedule."""
    _model_arguments(g, seed=0)
    g.add_argument("--prompt-ids", type=_ids, required=True,
                   help="comma-separated prompt token ids, e.g. 1,2,3")
    g.add_argument("--max-new-tokens", type=_positive, default=16, help="tokens to generate (default 16)")
    g.add_argument("--context", type=_positive, default=None,
                   help="KV positions the schedule is compiled for; the prompt and the new tokens must fit "
                        "(default: their count rounded up to a power of two, from 64 to "
                        f"{DEFAULT_MAX_CONTEXT})")
    g.add_argument("--backend", choices=("cpu", "cuda"), default="cpu",
                   help="cpu: the CPU executor runs the task list tile by tile (anywhere, slow); cuda: the "
                        "megakernel on an H100/H200 (default cpu)")
    g.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="weights and activations of the cpu backend (default float32; the cuda backend runs "
                        "bfloat16)")
    from mkc.ir.fp8 import WEIGHT_FORMATS

    g.add_argument("--weights", choices=WEIGHT_FORMATS, default="bf16", help=WEIGHTS_HELP)
    g.add_argument("--json", action="store_true", help='print {"tokens": [...]} (generated ids only)')


def _bench_arguments(b: argparse.ArgumentParser) -> None:
    """mkc bench: the model, the points to time, profiling, and the tuner's options."""
    _model_arguments(b, seed=2026)
    b.add_argument("--batch", type=_batches, default="1,2,4,8",
                   help="comma-separated batch sizes (default 1,2,4,8)")
    b.add_argument("--context", type=_contexts, default="8192",
                   help="comma-separated contexts (default 8192)")
    b.add_argument("--reps", type=_positive, default=20, help="timed steps per point (median reported)")
    b.add_argument("--profile", action="store_true",
                   help="also write a per-task Perfetto trace of a real step")
    b.add_argument("--tune", action="store_true",
                   help="time the schedule's choices at each point (attention SMs, priority raises, sibling "
                        "spread, the layer's end, global layers' splits) and record the fastest in "
                        "MKC_TUNING_FILE (default tuning.json in the kernel cache) for later compiles, "
                        "benches and servers")
    b.add_argument("--tune-rounds", type=_positive, default=1,
                   help="with --tune: time each decision's options in turn this many times, every other "
                        "round in reverse order, and compare medians (default 1: each schedule once)")
    b.add_argument("--tune-every-count", action="store_true",
                   help="with --tune: time every count of attention SMs, also those whose probe step the "
                        "compiler simulates more than 25%% slower than the fastest count's (by default left "
                        "out)")
    b.add_argument("--tune-tiles", action="store_true",
                   help="with --tune: last, also time the expert tiles' rows (each routing slot's gate/up "
                        "tiles in more or fewer equal tiles, then the expert-down tiles halved, quartered or "
                        "doubled) and record the fastest (docs/tiling.md)")
    b.add_argument("--weights", type=_weight_formats, default="bf16", metavar="FORMATS",
                   help="comma-separated weight formats timed one after the other in this run, e.g. bf16,fp8 "
                        "(each on freshly made weights; the PyTorch baseline runs beside bf16 only). "
                        + WEIGHTS_HELP)
    b.add_argument("--page-size", type=_page_size, default=0,
                   help="the megakernel's KV cache in pages of this many positions (default 0: one slab per "
                        "sequence)")
    b.add_argument("-o", "--output", default="build/bench", help="folder for bench.json and traces")


def cmd_quantize(a: argparse.Namespace) -> int:
    from mkc.runtime.quantize import quantize_main

    return quantize_main(a)


def cmd_serve(a: argparse.Namespace) -> int:
    try:
        from mkc.runtime.server import serve_main
    except ImportError as e:  # the serve extra is not installed
        raise UsageError(f"mkc serve needs the server dependencies ({e.name} is missing): "
                         f"pip install 'mkc[serve]'") from e
    return serve_main(a)


def cmd_bench_serve(a: argparse.Namespace) -> int:
    from mkc.runtime.serve_bench import bench_serve_main

    return bench_serve_main(a)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)
    if a.command is None:  # a bare `mkc`: what it can do
        parser.print_help()
        return 0
    try:
        return int(a.fn(a) or 0)
    except (SpecError, UsageError, *_user_errors()) as e:
        print(f"mkc: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except _schedule_error() as e:
        print(f"mkc: error: the schedule is unsafe: {e}", file=sys.stderr)
        return EXIT_UNSAFE
    except KeyboardInterrupt:
        print("mkc: interrupted", file=sys.stderr)
        return 130  # 128 + SIGINT, as shells report it


def _version() -> str:
    """The installed distribution's version, else the source tree's."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("mkc")
    except PackageNotFoundError:
        import mkc

        return mkc.__version__


def _user_errors() -> tuple[type[Exception], ...]:
    """Errors of later stages that mean bad input: a shape the kernel cannot take, a checkpoint that
    does not match its config (looked up only when one is raised, so that nothing is imported)."""
    found: list[type[Exception]] = []
    for module, name in (("mkc.codegen.render", "CodegenError"), ("mkc.runtime.weights", "CheckpointError")):
        mod = sys.modules.get(module)
        if mod is not None:
            found.append(getattr(mod, name))
    return tuple(found)


def _schedule_error() -> type[Exception]:
    try:
        from mkc.schedule.validator import ScheduleError
    except ImportError:  # validator not importable: never matches
        return type("NoScheduleError", (Exception,), {})
    return ScheduleError


if __name__ == "__main__":
    sys.exit(main())
