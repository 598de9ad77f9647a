"""Plan the schedules and build the kernels a GPU run will ask for, here on the CPU, into a cache to
carry to the device (so its minutes go to measuring, and mkc serve's start is measured warm).

    MKC_CACHE_DIR=$PWD/.mkc-cache/h python benchmarks/warm_cache.py --batch 1,2,4,8 --context 16384
    MKC_CACHE_DIR=$PWD/.mkc-cache/h python benchmarks/warm_cache.py --batch 1,8 --weights bf16,fp8

Each point goes through what the CUDA backend and mkc bench call (runtime/backends.py:
compile_schedule, then build_kernel), so the schedule cache (mkc/schedule/plan_cache.py) and the
kernel cache hold the same keys the device computes: the kernel's hashes its source, the templates
and the NVRTC version, which must match the device's (where it does not, the device compiles).
Then run the device command with MKC_CACHE_DIR naming the carried folder (benchmarks/gpu_session.sh).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from mkc.codegen import build_kernel
from mkc.ir.spec import load_spec
from mkc.runtime.backends import compile_schedule

ROOT = Path(__file__).resolve().parents[1]


def _ints(v: str) -> list[int]:
    return [int(x) for x in v.split(",")]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "north_mini_code.yaml"))
    ap.add_argument("--batch", type=_ints, default=[1, 2, 4, 8], help="batch sizes, comma-separated")
    ap.add_argument("--context", type=_ints, default=[8192], help="context buckets, comma-separated")
    ap.add_argument("--page-size", type=int, default=0, help="a paged KV cache's page size (mkc serve --page-size)")
    ap.add_argument("--kv-pages", type=int, default=0, help="its pool of pages (mkc serve --kv-pages)")
    ap.add_argument("--weights", default="bf16", help="weight formats, comma-separated (bf16, fp8, fp8-block)")
    ap.add_argument("--num-sms", type=int, default=132)
    a = ap.parse_args(argv)
    spec = load_spec(a.config)
    for fmt in a.weights.split(","):
        for context in a.context:
            for batch in a.batch:
                t0 = time.monotonic()
                sc = compile_schedule(spec, batch, context, a.num_sms, a.page_size, a.kv_pages, fmt)
                t1 = time.monotonic()
                art = build_kernel(sc, spec)
                print(f"{spec.name} {fmt} batch {batch} context {context}: schedule {t1 - t0:.1f} s, "
                      f"kernel {art.name} {time.monotonic() - t1:.1f} s", flush=True)


if __name__ == "__main__":
    main()
