"""Where a profiled megakernel step's warps stall, by op: ncu's PC samples attributed to the op each
SASS instruction belongs to (mkc.codegen.sass.instruction_owners; no GPU needed).

On the GPU machine, sample one step and export ncu's source page:

    ncu --clock-control none --section SourceCounters --section WarpStateStats -k regex:mkc_decode \\
        -s 2 -c 1 -o b1 python benchmarks/megakernel_step.py --batch 1 --reps 3
    ncu --import b1.ncu-rep --page source --csv --print-source sass > b1_sass.csv

then, with the kernel's cache folder (kernel.cubin and kernel.cu, under MKC_CACHE_DIR/kernels):

    python benchmarks/stalls_by_op.py KERNEL_DIR b1_sass.csv[.gz] [--reason stall_no_inst]

prints, per op, its share of all samples and how many of its own samples had each stall reason
named (default: no instruction to issue, i.e. instruction fetch: docs/kernel.md, "Code size").
With ``--op LINEAR`` it then breaks that op's samples down by source line (sass.instruction_lines:
the innermost line and, with ``--depth N``, the N - 1 lines it was inlined at), largest first: where
inside the op the warps stall, e.g. its staging against its stream.
"""

from __future__ import annotations

import argparse
import csv
import gzip
from collections import Counter
from pathlib import Path

from mkc.codegen.sass import instruction_lines, instruction_owners

ALL = "Warp Stall Sampling (All Samples)"


def read_samples(path: Path) -> tuple[list[str], list[list[str]]]:
    """ncu's source page as (header, rows), one row per SASS instruction in address order."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", newline="") as f:
        rows = list(csv.reader(f))
    start = next((i for i, r in enumerate(rows) if r and r[0] == "Address"), None)
    if start is None:
        raise SystemExit(f"{path}: no 'Address' header row: expected ncu --page source --csv --print-source sass")
    return rows[start], rows[start + 1:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kernel_dir", type=Path, help="the kernel's cache folder (kernel.cubin, kernel.cu)")
    ap.add_argument("samples", type=Path, help="ncu's source page as CSV (optionally .gz)")
    ap.add_argument("--reason", nargs="+", default=["stall_no_inst"], help="stall reason columns to break out")
    ap.add_argument("--op", default=None, help="also break this op's samples down by source line (e.g. LINEAR)")
    ap.add_argument("--depth", type=int, default=2, help="with --op: lines of the inline chain to key by")
    ap.add_argument("--top", type=int, default=30, help="with --op: the source lines to print")
    a = ap.parse_args()
    owners = instruction_owners((a.kernel_dir / "kernel.cubin").read_bytes(), (a.kernel_dir / "kernel.cu").read_text())
    header, rows = read_samples(a.samples)
    if len(rows) != len(owners):
        raise SystemExit(f"{a.samples} lists {len(rows)} instructions, {a.kernel_dir / 'kernel.cubin'} has "
                         f"{len(owners)}: expected the samples of this very kernel")
    missing = [c for c in (ALL, *a.reason) if c not in header]
    if missing:
        raise SystemExit(f"{a.samples}: no column {', '.join(missing)}; the columns are {', '.join(header)}")
    col = {c: header.index(c) for c in (ALL, *a.reason)}
    total: Counter[str] = Counter()
    by_reason: dict[str, Counter[str]] = {r: Counter() for r in a.reason}
    for owner, row in zip(owners, rows):
        total[owner] += int(row[col[ALL]] or 0)
        for r in a.reason:
            by_reason[r][owner] += int(row[col[r]] or 0)
    n = sum(total.values()) or 1
    print(f"{n} samples; " + ", ".join(f"{r} {sum(c.values()) / n:.1%}" for r, c in by_reason.items()))
    print(f"{'op':<22} {'samples':>9} {'share':>7}  " + "  ".join(f"{r + ' (own)':>22}" for r in a.reason))
    for owner, s in total.most_common():
        own = "  ".join(f"{by_reason[r][owner]:>13} {by_reason[r][owner] / max(s, 1):>7.1%}" for r in a.reason)
        print(f"{owner:<22} {s:>9} {s / n:>7.1%}  {own}")
    if a.op is not None:
        if a.op not in total:
            raise SystemExit(f"no op {a.op!r} in this kernel; its ops are {', '.join(sorted(total))}")
        by_line(a, owners, rows, col)


def by_line(a: argparse.Namespace, owners: list[str], rows: list[list[str]], col: dict[str, int]) -> None:
    """Op a.op's samples by the source lines of its instructions (their inline chains cut to
    a.depth), largest first, with how many of them had each reason."""
    chains = instruction_lines((a.kernel_dir / "kernel.cubin").read_bytes())
    total: Counter[tuple[str, ...]] = Counter()
    count: Counter[tuple[str, ...]] = Counter()
    by_reason: dict[str, Counter[tuple[str, ...]]] = {r: Counter() for r in a.reason}
    for owner, chain, row in zip(owners, chains, rows):
        if owner != a.op:
            continue
        key = chain[:a.depth] or ("(no line)",)
        total[key] += int(row[col[ALL]] or 0)
        count[key] += 1
        for r in a.reason:
            by_reason[r][key] += int(row[col[r]] or 0)
    n = sum(total.values()) or 1
    print(f"\n{a.op} by source line ({n} samples; innermost line first, then where it was inlined)")
    print(f"{'instructions':>12} {'samples':>9} {'share':>7}  " + "  ".join(f"{r:>13}" for r in a.reason) + "  line")
    for key, s in total.most_common(a.top):
        own = "  ".join(f"{by_reason[r][key]:>13}" for r in a.reason)
        print(f"{count[key]:>12} {s:>9} {s / n:>7.1%}  {own}  {' < '.join(key)}")


if __name__ == "__main__":
    main()
