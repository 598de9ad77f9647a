"""Prove that a change leaves the shipped kernels alone: a digest of each kernel's SASS and schedule.

    python benchmarks/sass_identity.py record benchmarks/results/sass_baseline.json
    python benchmarks/sass_identity.py check benchmarks/results/sass_baseline.json [--only b1/c8192 ...]

The shipped kernels are North Mini Code's at batch 1, 2, 4 and 8 and contexts 8K, 32K and 128K,
plus the point of every entry of configs/tuning/h200.json, each planned as ``mkc compile`` plans it
(the tuning table applied) and built with the default CodegenOptions. For each point the file
holds a digest of the kernel's SASS (cuobjdump's instruction text, addresses and encodings
stripped: instruction for instruction the same code has the same digest), its instruction count,
and a digest of the schedule (tasks with their present operands and arguments, queues, waits,
signals and counter targets), so a change that keeps the binary but moves a task shows too.
``check`` exits 1 naming every point that differs (``--only``: the points whose key starts so,
for a quick look while editing; the full check is what counts). Needs NVRTC and cuobjdump, no GPU; builds go
through the kernel cache (MKC_CACHE_DIR), two at a time.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "north_mini_code.yaml"
TUNING = ROOT / "configs" / "tuning" / "h200.json"
BATCHES = (1, 2, 4, 8)
CONTEXTS = (8192, 32768, 131072)
NUM_SMS = 132
WORKERS = 2  # NVRTC builds at once (each holds a CPU core for 10-30 s)

# a SASS instruction line of cuobjdump: /*0a40*/  <instruction> ;  /* 0x... */
_ADDRESS = re.compile(r"/\*[0-9a-f]{4,}\*/")
_ENCODING = re.compile(r"/\* 0x[0-9a-f]{16} \*/")


def sass_instructions(sass: str) -> list[str]:
    """The instruction text of cuobjdump -sass output, one per instruction, without addresses,
    encodings or whitespace differences; branch targets (.L_x_N labels) are kept, since they are
    numbered in code order."""
    out = []
    for line in sass.splitlines():
        if not _ADDRESS.search(line):
            continue
        text = _ENCODING.sub("", _ADDRESS.sub("", line)).strip()
        if text:
            out.append(" ".join(text.split()))
    return out


def points() -> list[tuple[int, int, int, int]]:
    """(batch, context, num_sms, page_size) of every shipped kernel: the grid, then the points of
    the tuning table's entries that the grid lacks."""
    grid = [(b, c, NUM_SMS, 0) for b in BATCHES for c in CONTEXTS]
    for key in json.loads(TUNING.read_text()):
        _, b, c, sms, page = key.rsplit("/", 4)
        p = (int(b[1:]), int(c[1:]), int(sms[3:]), int(page[4:]))
        if p not in grid:
            grid.append(p)
    return grid


def schedule_digest(sc) -> str:
    """What the kernel runs besides its binary: every task (op, name, the operands it has, its
    arguments by name), the queues, each task's waits and signal, and the counters' targets."""
    from mkc.ir.ops import OP_INFO

    h = hashlib.sha256()
    for t in sc.tasks:
        info = OP_INFO[t.op]
        operands = {r: b for r, b in zip(info.operands, t.operands) if b != "-"}
        h.update(json.dumps([t.op.name, t.name, operands, dict(zip(info.args, t.args))], sort_keys=True).encode())
    h.update(json.dumps([sc.queues, sc.waits, sc.signals, [c.target for c in sc.counters]]).encode())
    return h.hexdigest()


def digest_point(spec, point: tuple[int, int, int, int]) -> dict:
    from mkc.codegen import build_kernel
    from mkc.codegen.sass import disassemble
    from mkc.schedule.plan import plan

    batch, context, num_sms, page_size = point
    sc = plan(spec, batch, context, num_sms, page_size)
    art = build_kernel(sc, spec)
    sass = sass_instructions(disassemble(art.cubin))
    return {"sass_sha256": hashlib.sha256("\n".join(sass).encode()).hexdigest(), "instructions": len(sass),
            "regs": art.regs, "dynamic_smem": art.dynamic_smem, "schedule_sha256": schedule_digest(sc),
            "attention_sms": sc.meta["attention_sms"]["chosen"], "kernel": art.name}


def point_key(point: tuple[int, int, int, int]) -> str:
    b, c, sms, page = point
    return f"b{b}/c{c}/sms{sms}/page{page}"


def digests(only: tuple[str, ...] = ()) -> dict[str, dict]:
    """The digests of every shipped point (or those whose key starts with one of ``only``), keyed
    b<batch>/c<context>/sms<n>/page<p>."""
    os.environ["MKC_TUNING_FILE"] = str(TUNING)  # the shipped table alone, not a local tuning.json
    from mkc.ir.spec import load_spec

    spec = load_spec(CONFIG)
    pts = [p for p in points() if not only or point_key(p).startswith(only)]
    with ThreadPoolExecutor(WORKERS) as pool:
        results = list(pool.map(lambda p: digest_point(spec, p), pts))
    out = {}
    for p, r in zip(pts, results):
        key = point_key(p)
        out[key] = r
        print(f"{key}: {r['instructions']} instructions, sass {r['sass_sha256'][:12]}, "
              f"schedule {r['schedule_sha256'][:12]}", flush=True)
    return out


# fields that must match between a baseline and now (the kernel's name hashes its source, which
# changes with any template edit, so it is informational)
COMPARED = ("sass_sha256", "instructions", "regs", "dynamic_smem", "schedule_sha256", "attention_sms")


def compare(baseline: dict[str, dict], now: dict[str, dict]) -> list[str]:
    """Every point whose compared fields differ, or that one side lacks, as a line."""
    problems = []
    for key in sorted(set(baseline) | set(now)):
        if key not in now or key not in baseline:
            problems.append(f"{key}: only in the {'baseline' if key in baseline else 'new digests'}")
            continue
        diff = [f"{f} {baseline[key].get(f)} -> {now[key].get(f)}" for f in COMPARED
                if baseline[key].get(f) != now[key].get(f)]
        if diff:
            problems.append(f"{key}: " + "; ".join(diff))
    return problems


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=("record", "check"))
    ap.add_argument("file", type=Path, help="the digests JSON (written by record, read by check)")
    ap.add_argument("--only", nargs="+", default=[], help="check only the points whose key starts so (b1/c8192 ...)")
    a = ap.parse_args()
    now = digests(tuple(a.only))
    if a.mode == "record":
        if a.only:
            ap.error("record writes every point: leave out --only")
        a.file.parent.mkdir(parents=True, exist_ok=True)
        a.file.write_text(json.dumps(now, indent=1, sort_keys=True) + "\n")
        print(f"wrote {a.file}")
        return
    baseline = json.loads(a.file.read_text())
    if a.only:
        baseline = {k: v for k, v in baseline.items() if k in now}
    problems = compare(baseline, now)
    for p in problems:
        print("DIFFERS", p)
    print(f"{len(now)} kernels: " + (f"{len(problems)} differ" if problems else "SASS and schedules identical"))
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
